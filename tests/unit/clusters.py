"""Small hand-made clusters for placement tests."""

from __future__ import annotations

from gpupool_sched.model.cluster import GpuSpec, MigSlice, NodeSpec


def gpu_node(
    name: str, gpus: int, model: str = "A100", *, cpu: int = 64_000, mem: int = 256_000, gpu_mem: int = 40_960
) -> NodeSpec:
    return NodeSpec(
        name=name,
        cpu_milli=cpu,
        memory_mib=mem,
        gpus=tuple(GpuSpec(index=i, model=model, memory_mib=gpu_mem, uuid=f"GPU-{name}-{i}") for i in range(gpus)),
    )


def mig_node(name: str) -> NodeSpec:
    """GPU 0 split into 1g.10gb x4 + 3g.40gb... (A100-80GB style), GPU 1 whole."""
    slices = (
        MigSlice(f"MIG-{name}-0-a", "3g.40gb", 0),
        MigSlice(f"MIG-{name}-0-b", "1g.10gb", 0),
        MigSlice(f"MIG-{name}-0-c", "1g.10gb", 0),
    )
    return NodeSpec(
        name=name,
        cpu_milli=64_000,
        memory_mib=256_000,
        gpus=(
            GpuSpec(
                index=0, model="A100-80GB", memory_mib=81_920, uuid=f"GPU-{name}-0", mig_enabled=True, mig_slices=slices
            ),
            GpuSpec(index=1, model="A100-80GB", memory_mib=81_920, uuid=f"GPU-{name}-1"),
        ),
    )
