"""Errors every gpupool command reports the same way."""

from gpupool_common.clihelp import OneLineParser

__all__ = ["OneLineParser", "UserError"]


class UserError(Exception):
    """Bad input from the user: printed as one clear line, exit code 2, no traceback."""
