"""May a mover be moved by surge, and may the surge start now? Its ReplicaSet's Deployment annotated
`gpupool.io/migrate: surge` (`surging_deployment`), and that Deployment steady: still annotated, no rollout
under way, no HorizontalPodAutoscaler owning its count (`may_surge`). Read from the API server, not the
ledger: the scheduler watches no Deployments or ReplicaSets for this."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpupool_sched.cache.entries import PodEntry
from gpupool_sched.kube.kubeapi import ApiError, KubeApi, autoscalers_path, deployment_path, replica_set_path
from gpupool_sched.writer.surge_record import MIGRATE, REVISION, SURGE, Deployment, Outcome, Refused


async def surging_deployment(api: KubeApi, entry: PodEntry) -> Deployment | None:
    """The mover's Deployment when it is annotated `gpupool.io/migrate: surge`, else None (moved by
    eviction). ApiError when it cannot be told (the caller stops: a surge Deployment must not be
    evicted by mistake)."""
    kind, _, rest = entry.owner.partition("/")
    namespace, _, rs_name = rest.partition("/")
    if kind != "ReplicaSet" or not rs_name:
        return None
    try:
        rs = await api.read_object(replica_set_path(namespace, rs_name))
    except ApiError as exc:
        if exc.status == 404:
            return None  # the ReplicaSet is gone: nothing scales it; evicted as any other pod
        raise
    ref = next((r for r in (rs.get("metadata") or {}).get("ownerReferences") or ()
                if isinstance(r, Mapping) and r.get("controller") is True and r.get("kind") == "Deployment"),
               None)
    if ref is None or not isinstance(ref.get("name"), str):
        return None
    try:
        deployment = await api.read_object(deployment_path(namespace, ref["name"]))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    meta = deployment.get("metadata") or {}
    if (meta.get("annotations") or {}).get(MIGRATE) != SURGE:
        return None
    return Deployment(namespace, ref["name"], str(meta.get("uid", "")), rs_name, f"{namespace}/{ref['name']}")

async def steady(api: KubeApi, target: Deployment) -> tuple[dict[str, Any], int]:
    """The Deployment now and its spec.replicas, when a surge may start: still annotated, not rolling
    out (the mover's ReplicaSet is its current one, every replica updated), no HPA scaling it.
    Refused otherwise; ApiError 404 when it is gone."""
    deployment = await api.read_object(deployment_path(target.namespace, target.name))
    meta, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
    status = deployment.get("status") or {}
    if (meta.get("annotations") or {}).get(MIGRATE) != SURGE:
        raise Refused(f"Deployment {target.key} is no longer annotated {MIGRATE}: {SURGE}")
    replicas = spec.get("replicas", 1)
    rs = await api.read_object(replica_set_path(target.namespace, target.replica_set))
    rs_revision = ((rs.get("metadata") or {}).get("annotations") or {}).get(REVISION)
    if (meta.get("generation") != status.get("observedGeneration")
            or status.get("updatedReplicas", 0) != replicas or status.get("replicas", 0) != replicas
            or rs_revision != (meta.get("annotations") or {}).get(REVISION)):
        raise Refused(f"a rollout of Deployment {target.key} is under way (a new replica would go to "
                      "another ReplicaSet)")
    hpa = await autoscaler(api, target)
    if hpa is not None:
        raise Refused(f"HorizontalPodAutoscaler {target.namespace}/{hpa} scales Deployment {target.key}: "
                      "the scheduler does not change a count an HPA owns, and the surge annotation rules "
                      "out an eviction")
    if not isinstance(replicas, int) or replicas < 1:
        raise Refused(f"Deployment {target.key} has {replicas} replicas")
    return deployment, replicas

async def autoscaler(api: KubeApi, target: Deployment) -> str | None:
    """The name of an HPA (autoscaling/v2) whose scaleTargetRef is the Deployment, if any."""
    try:
        found = await api.read_object(autoscalers_path(target.namespace))
    except ApiError as exc:
        if exc.status == 404:
            return None  # autoscaling/v2 not served: no HPA
        raise
    for hpa in found.get("items") or ():
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        if ref.get("kind") == "Deployment" and ref.get("name") == target.name:
            return str((hpa.get("metadata") or {}).get("name", "?"))
    return None


async def may_surge(api: KubeApi, target: Deployment) -> Outcome | int:
    """The Deployment's spec.replicas when a surge may start now, else how it ends before anything is
    written (refused: an HPA, a rollout; failed: it could not be read)."""
    try:
        return (await steady(api, target))[1]
    except Refused as exc:
        return Outcome("refused", str(exc))
    except ApiError as exc:
        if exc.status == 404:
            return Outcome("refused", f"Deployment {target.key} is gone")
        return Outcome("failed", f"reading Deployment {target.key} failed: {exc}")
