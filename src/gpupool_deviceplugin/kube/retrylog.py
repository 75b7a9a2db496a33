"""One log line per state change for a loop that retries an API call with back-off (issue 22, item 7: the
plugin logged 50 lines in 20 s while the API server was unreachable).

The first failure, and a failure with another cause, is a WARNING saying that it retries; repeats of the
same cause are DEBUG; the first success after failures is an INFO line with how many attempts failed.
"""

from __future__ import annotations

import logging

__all__ = ["RetryLog", "root_cause"]


def root_cause(exc: BaseException) -> str:
    """The innermost reason of a client error in one line, e.g. `[Errno 111] Connection refused` rather than
    urllib3's MaxRetryError text with the URL and the whole chain."""
    seen = 0
    while isinstance(reason := getattr(exc, "reason", None), BaseException) and seen < 10:
        exc, seen = reason, seen + 1
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "[Errno" in text:
        text = text[text.index("[Errno"):].rstrip("')\"")
    return text[:300]


class RetryLog:
    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.log = logger
        self.what = what
        self.failures = 0
        self._cause: str | None = None

    def failed(self, exc: BaseException, retry_in_s: float) -> None:
        cause = root_cause(exc)
        self.failures += 1
        if cause != self._cause:
            self._cause = cause
            self.log.warning("%s failed: %s; retrying with back-off (next in %.1fs), quietly until it works or "
                             "fails another way", self.what, cause, retry_in_s)
        else:
            self.log.debug("%s failed again (%d times): %s; next try in %.1fs", self.what, self.failures, cause,
                           retry_in_s)

    def succeeded(self) -> None:
        if self.failures:
            self.log.info("%s works again after %d failed attempt(s)", self.what, self.failures)
        self.failures = 0
        self._cause = None
