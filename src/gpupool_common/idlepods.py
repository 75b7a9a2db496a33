"""The node annotation in which a device plugin publishes its idle pods (docs/idle-and-elastic.md).

    gpupool.io/idle-pods: {"<pod UID>": "2026-12-02T14:00:00Z", ...}

A pod is listed when it is idle, under the plugin's definition, on every GPU it holds on that node; the
value is when it became idle (its last activity). Absent or "{}": no idle pod.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

IDLE_PODS_ANNOTATION = "gpupool.io/idle-pods"


def idle_pods_annotation(idle_since: dict[str, float]) -> str:
    """Compact JSON, sorted (equal sets give equal text: the plugin patches only on change)."""
    return json.dumps({uid: datetime.fromtimestamp(int(t), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                       for uid, t in sorted(idle_since.items())}, separators=(",", ":"))


def parse_idle_pods(text: str | None) -> dict[str, datetime]:
    """Pod UID -> idle since; {} for an absent annotation. ValueError for one that is not this format."""
    if not text:
        return {}
    data = json.loads(text)
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"{IDLE_PODS_ANNOTATION} is not a JSON object of pod UID -> timestamp")
    return {uid: datetime.strptime(v, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) for uid, v in data.items()}
