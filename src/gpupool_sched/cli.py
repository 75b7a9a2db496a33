"""`gpupool` command line: one sub-command per module, each registering its own parser."""

from __future__ import annotations

import argparse
import importlib
import sys

from gpupool_sched.errors import UserError

# module path -> it exposes `register(subparsers)`; each parser sets `func(args) -> int`
__all__ = ["UserError", "build_parser", "main"]

SUBCOMMANDS = (
    "gpupool_sched.simulate.cli",
    "gpupool_sched.devcluster.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpupool", description="gpupool: one GPU pool for training and inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("gpupool"):
                raise
            _register_unavailable(sub, name, exc.name or "?")
            continue
        module.register(sub)
    return parser


def _register_unavailable(sub: argparse._SubParsersAction, module: str, missing: str) -> None:
    """A sub-command whose optional dependency is not installed still shows up and says why."""
    command = module.split(".")[-2].replace("devcluster", "dev-cluster")

    def fail(_: argparse.Namespace) -> int:
        raise UserError(f"needs the Python package {missing!r}: pip install 'gpupool[dev]'")

    p = sub.add_parser(command, help=f"(unavailable: needs {missing})", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=fail)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"gpupool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
