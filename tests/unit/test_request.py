import pytest

from gpupool_sched.model.request import InvalidRequest, PodRequest


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"cpu_milli": -1}, "cpu_milli is negative"),
        ({"gpu_count": 1}, "without gpu_milli"),
        ({"gpu_count": 1, "gpu_milli": 1500}, "exceeds one GPU"),
        ({"gpu_count": 2, "gpu_milli": 500}, "exactly one GPU"),
        ({"gpu_milli": 500}, "needs gpu_count=1"),
        ({"gpu_count": 1, "gpu_milli": 500, "gpu_memory_mib": 100}, "not both"),
        ({"mig_profile": "1g.10gb"}, "go together"),
        ({"mig_profile": "1g.10gb", "mig_count": 1, "gpu_count": 1, "gpu_milli": 1000}, "MIG slices or for GPUs"),
    ],
)
def test_malformed_requests_are_rejected_with_a_reason(kwargs, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        PodRequest(name="p", **kwargs)


def test_request_shapes():
    whole = PodRequest(name="w", gpu_count=2, gpu_milli=1000)
    share = PodRequest(name="s", gpu_count=1, gpu_milli=300)
    mem = PodRequest(name="m", gpu_count=1, gpu_memory_mib=10_240)
    cpu = PodRequest(name="c", cpu_milli=1000)
    assert whole.is_whole and not whole.is_shared and whole.gpu_milli_total == 2000
    assert share.is_shared and share.gpu_tag() == "share"
    assert mem.is_shared and mem.gpu_milli_total == 0
    assert cpu.gpu_tag() == "cpu" and not cpu.wants_gpu
    assert whole.gpu_tag() == "2-gpu"
