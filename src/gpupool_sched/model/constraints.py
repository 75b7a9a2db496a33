"""Where a pod may run besides resources: node selector, required node affinity, taints and tolerations.

Plain values with Kubernetes semantics (NodeSelectorRequirement, Taint, Toleration), so the scheduler
service converts a pod spec into them once and the filters (placement/nodeaffinity.py) evaluate them
per distinct node signature. All types are frozen and hashable: the filters cache by their value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpupool_sched.model.request import InvalidRequest

NODE_NAME_FIELD = "metadata.name"  # the one field nodeSelectorTerms.matchFields supports
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
HARD_EFFECTS = frozenset({"NoSchedule", "NoExecute"})  # effects that keep pods off the node
UNSCHEDULABLE_TAINT_KEY = "node.kubernetes.io/unschedulable"  # what a cordon means as a taint


def _int(text: str) -> int | None:
    try:
        return int(text, 10)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Requirement:
    """A NodeSelectorRequirement. ``key == "metadata.name"`` is a matchFields requirement on the node
    name (In/NotIn only); every other key is a label."""

    key: str
    operator: str
    values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.values, tuple):
            object.__setattr__(self, "values", tuple(self.values))
        problems = self.problems()
        if problems:
            what = f"node requirement {self.key} {self.operator} {list(self.values)}"
            raise InvalidRequest(f"{what}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        op, n = self.operator, len(self.values)
        if not self.key:
            return ["the key is empty"]
        if op not in OPERATORS:
            return [f"unknown operator {op!r} (one of {', '.join(OPERATORS)})"]
        if self.key == NODE_NAME_FIELD and op not in ("In", "NotIn"):
            return [f"matchFields on {NODE_NAME_FIELD} supports only In and NotIn"]
        if op in ("In", "NotIn") and n == 0:
            return [f"{op} needs at least one value"]
        if op in ("Exists", "DoesNotExist") and n:
            return [f"{op} takes no values"]
        if op in ("Gt", "Lt") and (n != 1 or _int(self.values[0]) is None):
            return [f"{op} takes exactly one integer value"]
        return []

    @property
    def on_node_name(self) -> bool:
        return self.key == NODE_NAME_FIELD

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        value = name if self.on_node_name else labels.get(self.key)
        op = self.operator
        if op == "In":
            return value is not None and value in self.values
        if op == "NotIn":
            return value is None or value not in self.values
        if op == "Exists":
            return value is not None
        if op == "DoesNotExist":
            return value is None
        number = _int(value) if value is not None else None
        if number is None:
            return False
        bound = int(self.values[0])
        return number > bound if op == "Gt" else number < bound


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __post_init__(self) -> None:
        if not self.key:
            raise InvalidRequest("taint: the key is empty")
        if self.effect not in TAINT_EFFECTS:
            effects = ", ".join(TAINT_EFFECTS)
            raise InvalidRequest(f"taint {self.key}: unknown effect {self.effect!r} (one of {effects})")

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


@dataclass(frozen=True, slots=True)
class Toleration:
    """Kubernetes semantics: an empty key with Exists tolerates every taint; an empty effect matches
    every effect; Exists ignores the value, Equal (or '') compares it."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.operator not in ("Equal", "Exists", ""):
            problems.append(f"unknown operator {self.operator!r} (Equal or Exists)")
        elif self.operator == "Exists" and self.value:
            problems.append("operator Exists takes no value")
        elif not self.key and self.operator != "Exists":
            problems.append("an empty key needs operator Exists")
        if self.effect and self.effect not in TAINT_EFFECTS:
            problems.append(f"unknown effect {self.effect!r} (one of {', '.join(TAINT_EFFECTS)}, or empty for all)")
        if problems:
            raise InvalidRequest(f"toleration {self.key or '*'}: " + "; ".join(problems))

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == taint.value


UNSCHEDULABLE_TAINT = Taint(UNSCHEDULABLE_TAINT_KEY, effect="NoSchedule")


@dataclass(frozen=True, slots=True)
class NodeConstraints:
    """A pod's node selector (label pairs, all must match), required node affinity
    (``affinity_terms``: ORed terms of ANDed requirements; an empty term matches no node; no terms: no
    affinity) and tolerations."""

    node_selector: tuple[tuple[str, str], ...] = ()
    affinity_terms: tuple[tuple[Requirement, ...], ...] = ()
    tolerations: tuple[Toleration, ...] = ()

    def __post_init__(self) -> None:
        # tuples, so the value stays hashable when a caller passes lists or a dict
        selector = self.node_selector.items() if isinstance(self.node_selector, Mapping) else self.node_selector
        object.__setattr__(self, "node_selector", tuple((str(k), str(v)) for k, v in selector))
        object.__setattr__(self, "affinity_terms", tuple(tuple(term) for term in self.affinity_terms))
        object.__setattr__(self, "tolerations", tuple(self.tolerations))
        for term in self.affinity_terms:
            for req in term:
                if not isinstance(req, Requirement):
                    raise InvalidRequest(f"node affinity term holds a {type(req).__name__}, not a Requirement")
        for tol in self.tolerations:
            if not isinstance(tol, Toleration):
                raise InvalidRequest(f"tolerations hold a {type(tol).__name__}, not a Toleration")

    @property
    def selects_nodes(self) -> bool:
        """Whether the selector or affinity can reject a node at all."""
        return bool(self.node_selector or self.affinity_terms)

    @property
    def uses_node_name(self) -> bool:
        return any(req.on_node_name for term in self.affinity_terms for req in term)

    def selector_matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.node_selector)

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        """Node selector AND required node affinity."""
        if not self.selector_matches(labels):
            return False
        if not self.affinity_terms:
            return True
        return any(term and all(req.matches(name, labels) for req in term) for term in self.affinity_terms)

    def tolerates(self, taint: Taint) -> bool:
        return any(t.tolerates(taint) for t in self.tolerations)

    def untolerated(self, taints: Sequence[Taint]) -> Taint | None:
        """The first NoSchedule/NoExecute taint no toleration covers (PreferNoSchedule never blocks)."""
        for taint in taints:
            if taint.effect in HARD_EFFECTS and not self.tolerates(taint):
                return taint
        return None
