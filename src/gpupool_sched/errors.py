"""Errors every gpupool command reports the same way."""


class UserError(Exception):
    """Bad input from the user: printed as one clear line, exit code 2, no traceback."""
