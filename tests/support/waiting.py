"""Polling for a condition in tests that watch real processes (plugin, scheduler, API server)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition", interval: float = 0.05) -> Any:
    """`check()`'s first truthy value; AssertionError naming `what` when none comes within `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met within {timeout}s"
        time.sleep(interval)
