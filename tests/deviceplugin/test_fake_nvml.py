"""The fake NVML backend speaks pynvml's API, and discovery turns each profile into the right inventory."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pynvml
import pytest

from gpupool_deviceplugin.discovery import discover, mig_profile_name
from gpupool_deviceplugin.nvml import session as session_module
from gpupool_deviceplugin.nvml.fake import FakeNvml
from gpupool_deviceplugin.nvml.numa import SysfsNuma, sysfs_bus_id
from gpupool_deviceplugin.nvml.profile import ProfileError, load_profile, profile_names
from gpupool_deviceplugin.nvml.session import open_fake


def _called_by_session() -> set[str]:
    return set(re.findall(r"self\.lib\.(nvml\w+)", Path(session_module.__file__).read_text()))


def test_fake_implements_every_nvml_call_the_product_makes() -> None:
    called = _called_by_session()
    assert len(called) > 20
    for name in sorted(called):
        assert hasattr(pynvml, name), f"{name} is not a pynvml function"
        assert callable(getattr(FakeNvml, name, None)), f"FakeNvml lacks {name}"


def test_fake_signatures_match_pynvml() -> None:
    for name, member in inspect.getmembers(FakeNvml, inspect.isfunction):
        if not name.startswith("nvml"):
            continue
        real = getattr(pynvml, name)
        fake_params = list(inspect.signature(member).parameters)[1:]  # drop self
        real_params = list(inspect.signature(inspect.unwrap(real)).parameters)
        assert fake_params == real_params, f"{name}: fake {fake_params} != pynvml {real_params}"


def test_fake_raises_pynvml_errors_and_returns_pynvml_structs() -> None:
    fake = FakeNvml("dgx-h100")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(8)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(fake.nvmlDeviceGetPciInfo(h), pynvml.nvmlPciInfo_t)
    assert fake.nvmlDeviceGetPciInfo(h).busId == "00000000:18:00.0"  # pynvml decodes on access
    assert isinstance(fake.nvmlDeviceGetMemoryInfo(h), pynvml.c_nvmlMemory_t)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(fake.nvmlEventSetCreate(), 10)
    l40s = FakeNvml("l40s-pcie")
    l40s.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        l40s.nvmlDeviceGetMigMode(l40s.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        l40s.nvmlDeviceGetNvLinkState(l40s.nvmlDeviceGetHandleByIndex(0), 0)


def test_injected_events_reach_nvml_event_wait(tmp_path: Path) -> None:
    events = tmp_path / "ev.jsonl"
    fake = FakeNvml("a100-mig", events_file=events)
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    for i in range(8):
        h = fake.nvmlDeviceGetHandleByIndex(i)
        fake.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(1), 3)
    gpu4 = fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(4))
    events.write_text(f'{{"uuid": "{fake.nvmlDeviceGetUUID(mig)}", "xid": 94}}\n'
                      f'{{"uuid": "{gpu4}", "event": "double_bit_ecc"}}\n')
    ev = fake.nvmlEventSetWait_v2(es, 100)
    assert (ev.eventType, ev.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 94)
    assert ev.gpuInstanceId == fake.nvmlDeviceGetGpuInstanceId(mig)
    assert fake.nvmlDeviceGetIndex(ev.device) == 1
    with pytest.raises(pynvml.NVMLError_Timeout):  # the ECC event is not registered: filtered like NVML does
        fake.nvmlEventSetWait_v2(es, 50)


def test_every_shipped_profile_loads() -> None:
    assert {"dgx-h100", "l40s-pcie", "nvlink-pairs", "a100-mig"} <= set(profile_names())
    for name in profile_names():
        assert load_profile(name).name == name
        assert load_profile(name).host.cpu


def test_bad_profiles_are_named(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="unknown fake NVML profile 'nope'"):
        load_profile("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nhost: {cpu: '1', memory: 1Gi}\ndefaults: {product: X, memory_mib: 1}\n"
                   "gpus:\n  - {index: 1, pci_bus_id: '00000000:01:00.0'}\n")
    with pytest.raises(ProfileError, match=r"indices must be 0\.\.0"):
        load_profile(bad)


def _inventory(profile: str, seed: str | None = None):
    s = open_fake(profile, seed=seed)
    s.init()
    return discover(s)


def test_discovery_dgx_h100() -> None:
    inv = _inventory("dgx-h100")
    assert [g.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {g.product for g in inv.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert all(g.memory_mib == 81559 and g.mig_capable and not g.mig_enabled for g in inv.gpus)
    assert len(inv.pairs) == 28 and {p.nvlinks for p in inv.pairs} == {18}
    for p in inv.pairs:
        assert p.pcie == ("NODE" if (p.a < 4) == (p.b < 4) else "SYSTEM")
    assert inv.driver_version == "550.54.15"


def test_discovery_l40s_has_no_nvlink_and_switch_pairs() -> None:
    inv = _inventory("l40s-pcie")
    assert not any(p.nvlinks for p in inv.pairs) and not any(g.mig_capable for g in inv.gpus)
    levels = {(p.a, p.b): p.pcie for p in inv.pairs}
    assert levels[(0, 1)] == "SINGLE" and levels[(2, 3)] == "SINGLE" and levels[(1, 2)] == "SYSTEM"


def test_discovery_counts_bridge_links_once() -> None:
    inv = _inventory("nvlink-pairs")
    linked = {(p.a, p.b): p.nvlinks for p in inv.pairs if p.nvlinks}
    assert linked == {(0, 2): 12, (1, 3): 12, (4, 6): 12, (5, 7): 12}
    topology = inv.topology()
    assert topology.nvlinks[2][0] == 12 and topology.gpu_count == 8


def test_discovery_mig_devices() -> None:
    inv = _inventory("a100-mig")
    assert [g.mig_enabled for g in inv.gpus] == [True, True, True] + [False] * 5
    assert [m.profile for m in inv.gpus[1].mig_devices] == ["2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb"]
    three = inv.gpus[1].mig_devices[3]
    assert (three.memory_mib, three.placement_start, three.placement_size) == (40192, 4, 4)
    uuids = [m.uuid for g in inv.gpus for m in g.mig_devices]
    assert len(uuids) == len(set(uuids)) == 13 and all(u.startswith("MIG-") for u in uuids)


def test_uuids_are_seeded_by_node_name() -> None:
    a, a2, b = _inventory("l40s-pcie", "node-a"), _inventory("l40s-pcie", "node-a"), _inventory("l40s-pcie", "node-b")
    assert [g.uuid for g in a.gpus] == [g.uuid for g in a2.gpus]
    assert not {g.uuid for g in a.gpus} & {g.uuid for g in b.gpus}


@pytest.mark.parametrize(("gi", "ci", "mig_mib", "gpu_mib", "name"), [
    (1, 1, 9728, 81920, "1g.10gb"),     # A100 80GB
    (2, 2, 19968, 81920, "2g.20gb"),
    (3, 3, 40192, 81920, "3g.40gb"),
    (7, 7, 80896, 81920, "7g.80gb"),
    (1, 1, 4864, 40960, "1g.5gb"),      # A100 40GB
    (3, 3, 20096, 40960, "3g.20gb"),
    (1, 1, 9984, 81559, "1g.10gb"),     # H100 80GB
    (1, 1, 20224, 81559, "1g.20gb"),
    (1, 1, 5888, 24258, "1g.6gb"),      # A30
    (3, 1, 40192, 81920, "1c.3g.40gb"),  # compute instance smaller than its GPU instance
])
def test_mig_profile_names(gi: int, ci: int, mig_mib: int, gpu_mib: int, name: str) -> None:
    assert mig_profile_name(gi, ci, mig_mib, gpu_mib) == name


def test_sysfs_numa(tmp_path: Path) -> None:
    for bus, value in (("0000:18:00.0", "1\n"), ("0000:2a:00.0", "-1\n")):
        d = tmp_path / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(value)
    numa = SysfsNuma(tmp_path)
    assert sysfs_bus_id("00000000:2A:00.0") == "0000:2a:00.0"
    assert numa("00000000:18:00.0") == 1
    assert numa("00000000:2A:00.0") is None  # -1: no NUMA affinity
    assert numa("00000000:99:00.0") is None
