"""The time simulator's retry test (timeline.py's rule): could a waiting pod, or a gang's member, fit on a
node by count alone (CPU, memory, and enough GPUs with enough free milli of an accepted model)? Room freed
on a node where it could not wakes nothing for it."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def fits_by_count(cpu: int, mem: int, free: Sequence[tuple[int, str]], need_cpu: int, need_mem: int, gpus: int,
                  milli: int, models: Collection[str]) -> bool:
    """`cpu`, `mem` and `free` ((free milli, model) per usable GPU) are the node's; the rest the request's
    (`models` empty: any)."""
    if need_cpu > cpu or need_mem > mem:
        return False
    return not gpus or sum(1 for f, model in free if f >= milli and (not models or model in models)) >= gpus
