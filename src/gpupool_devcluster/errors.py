"""The one error type of the dev cluster library: its message is a single line meant for a person."""

from __future__ import annotations


class DevClusterError(Exception):
    """The dev cluster cannot do what was asked: not built, not running, bad input, a part failed to start."""
