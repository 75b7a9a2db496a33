"""The FGD paper's allocation metric.

After every arriving pod: ``arrived`` = GPU milli requested by all pods so far (failed ones too),
``used`` = GPU milli allocated. The curve's value at x% arrived is the mean allocated % over the
events whose arrived % rounds to x (falling back to x±1 when none does), as the paper's analysis
scripts compute it.
"""

from __future__ import annotations

import numpy as np

CURVE_MAX_PCT = 130


def allocation_curve(arrived_milli: np.ndarray, used_milli: np.ndarray, total_gpus: int) -> dict[int, float]:
    """Mean allocated GPU % per arrived GPU % (0..130); points without nearby events are omitted."""
    arrived_pct = np.array([round(v) for v in (arrived_milli / total_gpus / 10).tolist()], dtype=np.int64)
    alloc_pct = np.array([round(v, 2) for v in (used_milli / total_gpus / 10).tolist()])
    curve: dict[int, float] = {}
    for x in range(CURVE_MAX_PCT + 1):
        sel = arrived_pct == x
        if not sel.any():
            sel = (arrived_pct >= x - 1) & (arrived_pct <= x + 1)
            if not sel.any():
                continue
        curve[x] = round(float(alloc_pct[sel].mean()), 2)
    return curve
