#!/usr/bin/env python3
"""One short check of the device plugin's real NVML path, for a machine with an NVIDIA GPU.

    .venv/bin/python hack/check_real_nvml.py [--out DIR] [--no-plugin]

1. Discovery through the real `pynvml` (libnvidia-ml.so.1): prints the inventory JSON the plugin would
   publish, an nvidia-smi-like topology matrix and the MIG state; checks it against independent NVML
   and sysfs reads (device count, UUIDs, NUMA node via nvmlDeviceGetNumaNodeId when the driver has it).
2. Health plumbing: an NVML event set with the critical events registered, one bounded wait, and a
   probe of every GPU.
2b. Activity counters for idleness (docs/idle-and-elastic.md): two rounds of NvmlSession.read_activity per
   GPU 1 s apart (the driver's utilisation sample buffer or the current rate, per-process samples and
   running processes, memory used, power), checked for plausible values; --load SECONDS also keeps GPU 0
   busy with a CUDA matmul loop (torch or cupy, when installed) and checks that the activity shows.
3. Unless --no-plugin: the plugin process itself on real NVML (no API server) against the kubelet
   stand-in of the tests: registration, ListAndWatch with every GPU Healthy and its NUMA node,
   GetPreferredAllocation and one Allocate.
Exits 1 on the first failed check and says which. Takes well under a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a script, not run from the repo root: the test support package, tests.support


class CheckFailed(AssertionError):
    pass


def check(condition: bool, what: str) -> None:
    print(f"  [{'ok' if condition else 'FAIL'}] {what}")
    if not condition:
        raise CheckFailed(what)


def discovery(out: Path | None, fake: str | None, load_s: float = 0.0) -> dict:
    import pynvml

    from gpupool_deviceplugin.config import PluginConfig
    from gpupool_deviceplugin.discovery import discover
    from gpupool_deviceplugin.nvml.session import open_fake, open_real
    from gpupool_deviceplugin.publication import build_publication
    from gpupool_deviceplugin.resources import build_resources

    print(f"1. discovery through {'the FAKE NVML profile ' + fake if fake else 'the real NVML'}")
    session = open_fake(fake, seed="real-check") if fake else open_real()
    session.init()
    t0 = time.perf_counter()
    inv = discover(session)
    took = time.perf_counter() - t0
    pub = build_publication(inv, build_resources(inv, PluginConfig(), memory_units=True), PluginConfig())
    print(json.dumps(json.loads(pub.annotations["gpupool.io/gpu-inventory"]), indent=2))
    print("labels:", json.dumps(pub.labels, indent=2))
    print("capacity:", pub.capacity)
    print_topology(inv)
    check(len(inv.gpus) == session.lib.nvmlDeviceGetCount() > 0, f"{len(inv.gpus)} GPUs, as nvmlDeviceGetCount says")
    check(len({g.uuid for g in inv.gpus}) == len(inv.gpus), "GPU UUIDs are unique")
    check(all(g.uuid.startswith("GPU-") and g.memory_mib > 0 for g in inv.gpus), "UUIDs and memory sizes look right")
    check(len(inv.pairs) == len(inv.gpus) * (len(inv.gpus) - 1) // 2, "a topology level for every GPU pair")
    for g in inv.gpus:
        try:
            nvml_numa = session.lib.nvmlDeviceGetNumaNodeId(session.lib.nvmlDeviceGetHandleByIndex(g.index))
        except (pynvml.NVMLError, AttributeError) as exc:
            print(f"  [skip] GPU {g.index}: nvmlDeviceGetNumaNodeId unavailable ({exc}); sysfs says {g.numa_node}")
            continue
        nvml_numa = None if nvml_numa < 0 else nvml_numa
        check(nvml_numa == g.numa_node, f"GPU {g.index}: sysfs NUMA node {g.numa_node} == NVML's {nvml_numa}")
    for g in inv.gpus:
        if g.mig_enabled:
            migs = ", ".join(f"{m.profile}@{m.placement_start} ({m.uuid})" for m in g.mig_devices)
            print(f"  GPU {g.index} MIG: {migs}")
    check(took < 30, f"discovery took {took:.2f}s")

    print("2. health plumbing")
    handles = [session.handle_by_uuid(g.uuid) for g in inv.gpus]
    event_set, unwatched = session.create_event_set(handles)
    print(f"  GPUs without critical NVML events: {unwatched or 'none'}")
    t0 = time.perf_counter()
    event = session.wait_event(event_set, 200)
    print(f"  one 200 ms event wait returned {event} after {time.perf_counter() - t0:.3f}s")
    session.free_event_set(event_set)
    for g in inv.gpus:
        problem = session.probe(g.uuid)
        check(problem is None, f"GPU {g.index} answers NVML probes ({problem or 'fine'})")
    activity(session, inv, load_s)
    session.shutdown()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "real_nvml_inventory.json").write_text(pub.annotations["gpupool.io/gpu-inventory"] + "\n")
    return {"inventory": inv, "capacity": pub.capacity}


def activity(session, inv, load_s: float) -> None:
    print("2b. activity counters (idleness)")
    measured = [g for g in inv.gpus if not g.mig_enabled]
    seen: dict[str, tuple[int, int]] = {}
    for round_ in (1, 2):
        for g in measured:
            h = session.handle_by_uuid(g.uuid)
            r = session.read_activity(h, *seen.get(g.uuid, (0, 0)))
            seen[g.uuid] = (r.device_seen_us, r.process_seen_us)
            procs = "unsupported" if r.processes is None else f"{len(r.processes)} sampled"
            running = "unsupported" if r.process_memory is None else f"{len(r.process_memory)} running"
            print(f"  round {round_} GPU {g.index}: activity {r.activity_pct} % ({r.source}), per-process {procs}, "
                  f"processes {running}, memory {r.memory_used}/{r.memory_total} B, power {r.power_w} W")
            check(r.memory_total is not None and r.memory_total > 0 and 0 <= (r.memory_used or 0) <= r.memory_total,
                  f"GPU {g.index}: memory used within total")
            check(r.activity_pct is None or 0 <= r.activity_pct <= 100, f"GPU {g.index}: activity is a percentage")
            check(r.power_w is None or 0 < r.power_w < 2000, f"GPU {g.index}: power is plausible")
            check(r.processes is None or all(0 <= v <= 100 for v in r.processes.values()),
                  f"GPU {g.index}: per-process activity are percentages")
        if round_ == 1:
            time.sleep(1.0)
    if load_s > 0 and measured:
        g = measured[0]
        busy = run_load(g.index, load_s)
        if busy is None:
            print("  [skip] --load: neither torch nor cupy is installed")
            return
        h = session.handle_by_uuid(g.uuid)
        r = session.read_activity(h, *seen[g.uuid])
        print(f"  under load: activity {r.activity_pct} % ({r.source}), processes {r.processes}, power {r.power_w} W")
        check((r.activity_pct or 0) >= 50, f"GPU {g.index}: a {load_s:g}s matmul loop reads as busy")
        check(r.processes is None or any(v > 0 for v in r.processes.values()),
              f"GPU {g.index}: the loop's process has per-process samples above 0")


def run_load(index: int, seconds: float) -> bool | None:
    """A matmul loop on GPU `index` for `seconds` (torch, else cupy); None when neither is installed."""
    try:
        import torch  # type: ignore[import-not-found]

        a = torch.randn(4096, 4096, device=f"cuda:{index}")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(index)
        return True
    except ImportError:
        pass
    try:
        import cupy  # type: ignore[import-not-found]

        with cupy.cuda.Device(index):
            a = cupy.random.randn(4096, 4096, dtype=cupy.float32)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                a = cupy.clip(a @ a, -1, 1)
            cupy.cuda.Device(index).synchronize()
        return True
    except ImportError:
        return None


def print_topology(inv) -> None:
    n = len(inv.gpus)
    cell = {(p.a, p.b): (f"NV{p.nvlinks}" if p.nvlinks else p.pcie[:4]) for p in inv.pairs}
    print("topology (NV<k>: k NVLinks; else the PCIe level):")
    print("       " + "".join(f"GPU{b:<4}" for b in range(n)) + "NUMA")
    for a in range(n):
        row = "".join(f"{'X' if a == b else cell[(min(a, b), max(a, b))]:<7}" for b in range(n))
        print(f"GPU{a:<4}{row}{inv.gpus[a].numa_node}")


def plugin_run(found: dict, fake: str | None) -> None:
    from tests.support.kubelet_standin import KubeletStandin
    from tests.support.plugin_process import PluginProcess

    inv = found["inventory"]
    print("3. the plugin process on real NVML against the kubelet stand-in")
    with tempfile.TemporaryDirectory(prefix="gpr-") as tmp:
        kdir = Path(tmp) / "k"
        kdir.mkdir()
        kubelet = KubeletStandin(kdir)
        kubelet.start()
        plugin = PluginProcess(Path(tmp), kdir, fake, node="real-check").start()
        try:
            expected = {r for r in found["capacity"] if r != "nvidia.com/gpu-memory"}  # no API server here
            regs = kubelet.wait_registered(expected, timeout=30)
            check(set(regs) == expected, f"registered {sorted(regs)}")
            whole = [g for g in inv.gpus if not g.mig_enabled]
            if whole:
                client = kubelet.plugin("nvidia.com/gpu")
                watch = client.watch()
                devices = watch.wait(lambda lst: len(lst.devices) == len(whole), timeout=10).devices
                watch.close()
                check(all(d.health == "Healthy" for d in devices.values()), "every whole GPU Healthy")
                for g in whole:
                    want = [] if g.numa_node is None else [g.numa_node]
                    check([x.ID for x in devices[g.uuid].topology.nodes] == want, f"GPU {g.index} TopologyInfo {want}")
                size = min(2, len(whole))
                chosen = client.preferred([g.uuid for g in whole], size)
                check(len(chosen) == size, f"GetPreferredAllocation({size}) -> {chosen}")
                resp = client.allocate(chosen)
                check(resp.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(chosen), "Allocate sets NVIDIA_VISIBLE_DEVICES")
            check(plugin.wait_healthz(200, timeout=10) == "ok\n", "/healthz ok")
        finally:
            code = plugin.stop()
            kubelet.stop()
            print("  plugin log tail:\n    " + "\n    ".join(plugin.log().splitlines()[-8:]))
        check(code == 0, f"plugin exited cleanly ({code})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the discovered inventory JSON here")
    parser.add_argument("--no-plugin", action="store_true", help="skip step 3 (the plugin process)")
    parser.add_argument("--fake-nvml", metavar="PROFILE", help="dry run of this script on a fake profile")
    parser.add_argument("--load", type=float, default=0.0, metavar="SECONDS",
                        help="keep GPU 0 busy this long (torch or cupy) and check the activity counters see it")
    args = parser.parse_args(argv)
    try:
        found = discovery(args.out, args.fake_nvml, args.load)
        if not args.no_plugin:
            plugin_run(found, args.fake_nvml)
    except CheckFailed as exc:
        print(f"FAILED: {exc}")
        return 1
    except Exception as exc:
        print(f"FAILED with {type(exc).__name__}: {exc}")
        return 1
    print("fake NVML dry run passed" if args.fake_nvml else "real NVML check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
