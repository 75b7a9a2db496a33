"""Writing a simulation's `--json` and `--plot` files: one clear line (UserError) when the disk refuses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpupool_sched.errors import UserError


def write_outputs(json_path: Path | None, payload: Callable[[], Any], plot_path: Path | None,
                  draw: Callable[[Path], None]) -> None:
    """`payload()` as indented JSON to `json_path`, `draw(plot_path)`, each only when its path is given.
    The paths were checked before the run; the disk may still fill up."""
    if json_path:
        try:
            json_path.write_text(json.dumps(payload(), indent=1) + "\n")
        except OSError as exc:
            raise UserError(f"--json {json_path}: cannot write: {exc.strerror or exc}") from None
        print(f"JSON report: {json_path}")
    if plot_path:
        try:
            draw(plot_path)
        except OSError as exc:
            raise UserError(f"--plot {plot_path}: cannot write: {exc.strerror or exc}") from None
        print(f"plot: {plot_path}")
