"""What every command line of gpupool shares (`gpupool ...`, `gpupool-deviceplugin`, `kubectl gpupool`):
help that shows each option's default, and log levels in either case."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["LOG_LEVELS", "DefaultsHelpFormatter", "OneLineParser", "decode_utf8", "log_level", "one_line"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help when it has a default worth showing: not None, False or
    empty, and not already named in the help text ("default" in it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or default == []
                or "default" in text.lower() or not action.option_strings or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def one_line(message: str) -> str:
    """A message as one line: a line break or another control character (from an argument, a file name) is
    written escaped, as Python writes it ("\\n", "\\x1e"), so it cannot split the line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)


class OneLineParser(argparse.ArgumentParser):
    """Bad flags give one line (`prog: error: ...; see prog --help`) and exit 2, not the usage block.
    Sub-command parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def log_level(text: str) -> str:
    """``--log-level``: any case in, lower case out (``logging`` takes its upper case)."""
    value = text.strip().lower()
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {text!r}: use one of {', '.join(LOG_LEVELS)} (any case)")
    return value


def decode_utf8(raw: bytes) -> tuple[str | None, str]:
    """(text, "") or (None, where the first byte that is not UTF-8 is: "line N, column M: byte 0xff"), so that
    an error names the line, not a byte offset."""
    try:
        return raw.decode("utf-8"), ""
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        return None, f"line {line}, column {column}: byte 0x{raw[exc.start]:02x}"
