"""metav1.LabelSelector matching, shared by the PodDisruptionBudgets preemption ranks victims with and
the GpuQuotas' namespace selectors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A metav1.LabelSelector. Empty (`{}`) selects everything; an unknown operator selects nothing
    (callers that validate refuse it earlier)."""

    match_labels: tuple[tuple[str, str], ...] = ()
    expressions: tuple[tuple[str, str, frozenset[str]], ...] = ()  # key, operator, values

    def matches(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.match_labels):
            return False
        for key, op, values in self.expressions:
            have = key in labels
            if op == "In" and not (have and labels[key] in values):
                return False
            if op == "NotIn" and have and labels[key] in values:
                return False
            if op == "Exists" and not have:
                return False
            if op == "DoesNotExist" and have:
                return False
            if op not in OPERATORS:
                return False
        return True
