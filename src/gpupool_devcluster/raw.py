"""Calls of the `kubernetes` client made with `_preload_content=False`: the client's model decoding is where
bulk operations spend their time, so these responses are read as JSON or discarded, and always handed back
to the connection pool (an unreleased response would cost a new TLS connection for the next request)."""

from __future__ import annotations

import json
from typing import Any

from urllib3 import BaseHTTPResponse


def read_json(response: BaseHTTPResponse) -> Any:
    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


def discard(response: BaseHTTPResponse) -> None:
    try:
        response.drain_conn()
    finally:
        response.release_conn()
