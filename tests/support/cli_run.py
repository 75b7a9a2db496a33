"""`gpupool ...` in this process, its exit code and output captured (argparse's SystemExit included)."""

from __future__ import annotations

import contextlib
import io

import gpupool_sched.cli as gpupool_cli


def run(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `gpupool <argv>`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = gpupool_cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()
