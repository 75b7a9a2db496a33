"""The room a preemption's placement counts on beyond what its victims free (`held_room`): what the
nominator holds for the preemptor while its victims terminate (docs/preemption.md). Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace

from gpupool_sched.model.cluster import ClusterSnapshot
from gpupool_sched.model.decision import Placement
from gpupool_sched.model.request import MILLI, PodRequest
from gpupool_sched.placement.preemption import RunningPod


def held_room(snapshot: ClusterSnapshot, node: str, takes: Iterable[tuple[PodRequest, Placement]],
              victims: Iterable[RunningPod], name: str, priority: int,
              namespace: str = "default") -> list[tuple[PodRequest, Placement]]:
    """What placing ``takes`` (a preemptor's placement, or a gang's members on one node) on ``node``
    needs beyond what ``victims`` free there: the room the plan counts on that is free already. The
    nominator holds it for the preemptor while it waits, as kube-scheduler counts a nominated pod on its
    node against pods of its priority or lower (docs/preemption.md). Returned as (request, placement)
    pairs that ``snapshot.assume`` accounts exactly: per GPU the milli and memory taken beyond what the
    victims free (one pair per distinct amount; a whole GPU less a victim's memory share is a 999-milli
    part with that memory plus a 1-milli part, as only a 1000-milli part takes the GPU's whole memory),
    the free MIG devices and the CPU and memory beyond the victims' with the first pair. Each pair is
    a CPU-only request of ``priority``, named ``name``. Empty when the victims free all of it (or the
    snapshot no longer has the node)."""
    row = snapshot.index.get(node)
    if row is None:
        return []
    need_milli: dict[int, int] = defaultdict(int)
    need_mem: dict[int, int] = defaultdict(int)
    freed_milli: dict[int, int] = defaultdict(int)
    freed_mem: dict[int, int] = defaultdict(int)

    def count(placement: Placement, milli: dict[int, int], mem: dict[int, int]) -> set[str]:
        for part in placement.parts():
            for j in part.gpu_indices:
                milli[j] += part.gpu_milli
                mem[j] += int(snapshot.gpu_mem_total[row, j]) if part.gpu_milli == MILLI else part.gpu_memory_mib
        return {u for part in placement.parts() for u in part.mig_devices}

    cpu = memory = 0
    mig: set[str] = set()
    for request, placement in takes:
        if placement.node == node:
            mig |= count(placement, need_milli, need_mem)
            cpu, memory = cpu + request.cpu_milli, memory + request.memory_mib
    for victim in victims:
        if victim.node == node:
            mig -= count(victim.placement, freed_milli, freed_mem)
            cpu, memory = cpu - victim.request.cpu_milli, memory - victim.request.memory_mib
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for j in sorted(need_milli):
        milli = max(0, need_milli[j] - freed_milli[j])
        mem = max(0, need_mem[j] - freed_mem[j])
        total = int(snapshot.gpu_mem_total[row, j])
        if milli >= MILLI and mem >= total:
            groups[(MILLI, 0)].append(j)
        elif milli >= MILLI:  # a 1000-milli part would take the memory a victim's hold keeps too
            groups[(MILLI - 1, mem)].append(j)
            groups[(1, 0)].append(j)
        elif milli or mem:
            groups[(milli, mem)].append(j)
    parts = [Placement(node, tuple(gpus), milli, mem)
             for (milli, mem), gpus in sorted(groups.items(), reverse=True)]
    if mig:
        first = parts[0] if parts else Placement(node)
        parts = [replace(first, mig_devices=tuple(sorted(mig))), *parts[1:]]
    cpu, memory = max(0, cpu), max(0, memory)
    if not parts and (cpu or memory):
        parts = [Placement(node)]
    return [(PodRequest(name, cpu_milli=cpu if k == 0 else 0, memory_mib=memory if k == 0 else 0,
                        priority=priority, namespace=namespace), part) for k, part in enumerate(parts)]
