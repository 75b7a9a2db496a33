"""Errors every gpupool command reports the same way."""

import argparse
from typing import NoReturn


class UserError(Exception):
    """Bad input from the user: printed as one clear line, exit code 2, no traceback."""


class OneLineParser(argparse.ArgumentParser):
    """Bad flags give one line (`prog: error: ...; see prog --help`) and exit 2, not the usage block.
    Sub-command parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
