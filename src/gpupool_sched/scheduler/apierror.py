"""A failed call to the API server, whichever client made it."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException


class ApiError(Exception):
    """A failed API call: HTTP status (0: no answer) and the server's message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @classmethod
    def from_body(cls, status: int, reason: str, raw: bytes) -> ApiError:
        """From an HTTP answer: the Status object's reason and message when the body is one."""
        message = reason
        try:
            body = json.loads(raw or b"{}")
            if isinstance(body, dict):
                message = body.get("message") or message
                reason = body.get("reason") or reason
        except ValueError:
            message = raw[:200].decode("utf-8", "replace") or message
        return cls(status, reason or "Error", str(message))

    @classmethod
    def from_exception(cls, exc: Exception) -> ApiError:
        if isinstance(exc, ApiException):
            message = exc.reason or ""
            try:
                body = json.loads(exc.body or "{}")
                message = body.get("message") or message
                reason = body.get("reason") or exc.reason or "Error"
            except (ValueError, AttributeError):
                reason = exc.reason or "Error"
            return cls(int(exc.status or 0), str(reason), str(message))
        return cls(0, type(exc).__name__, str(exc))

    @property
    def kind(self) -> str:
        """A short label for metrics: conflict, not_found, forbidden, timeout, server, other."""
        return {409: "conflict", 404: "not_found", 403: "forbidden", 422: "invalid", 429: "throttled"}.get(
            self.status, "server" if self.status >= 500 else ("unreachable" if self.status == 0 else "other")
        )
