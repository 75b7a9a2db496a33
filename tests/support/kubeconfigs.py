"""Kubeconfig files for tests that point a program at a server of the test's choice (an unreachable one,
for the start-up errors) with no real credentials."""

from __future__ import annotations

from pathlib import Path

import yaml


def token_kubeconfig(folder: Path, server: str) -> Path:
    """<folder>/kubeconfig: one context for `server`, a bearer token, TLS not verified."""
    path = folder / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    return path
