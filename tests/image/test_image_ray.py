"""gpupool-ray:<version> (out/image/gpupool-ray-<version>.oci.tar), the image of deploy/ray/sweep-rayjob.yaml,
run with runc the way KubeRay runs it: read-only root with a tmpfs at /tmp (the manifest's emptyDir), as the
image's user, loopback only. One container runs what KubeRay's head pod and K8sJobMode submitter run:

- the head: `ray start --head ... --block` with the parameters KubeRay adds (dashboard on 0.0.0.0, dashboard
  agent on 52365, metrics on 8080), started by `/bin/bash -c` as KubeRay starts it;
- the manifest's probes: HTTP GET /api/healthz on 52365 answers 200 (what the kubelet checks), and the
  dashboard's /api/gcs_healthz answers "success";
- the sweep's driver on the head: `gpupool simulate sweep --ray auto`;
- KubeRay's submitter command, in its K8sJobMode shape (wait for the dashboard with `python -c`, `ray job
  status`, `ray job submit --no-wait`, `ray job logs --follow`), with the manifest's entrypoint, then `ray
  job status` says SUCCEEDED.

Both sweeps' result files are byte-identical to the same grid run in local processes outside the container.
Needs root, runc and the built image; skipped without them, except where GPUPOOL_IMAGE_TESTS=required."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpupool_sched.cli import main
from tests.support.image import RAY_ARCHIVE, Bundle, missing_for_runc, require_or_skip, unpack

GRID = {"traces": ["default"], "seeds": [3], "policies": ["fgd", "gpupool"], "parameters": {"ratio": 0.1}}
JOB_ID = "gpupool-sweep-image-test"
DASHBOARD = "http://127.0.0.1:8265"

# KubeRay's generated head command (ray-operator/controllers/ray/common/pod.go: setMissingRayStartParams,
# generateRayStartCommand) plus --node-ip-address, since the container has loopback only
HEAD = ("ray start --head --dashboard-host=0.0.0.0 --metrics-export-port=8080 --block"
        " --dashboard-agent-listen-port=52365 --num-cpus=2 --num-gpus=0 --node-ip-address=127.0.0.1")
PROBE = ("import sys, time, urllib.request\n"
         "for _ in range(120):\n"
         "    try:\n"
         "        with urllib.request.urlopen('http://127.0.0.1:52365/api/healthz', timeout=2) as r:\n"
         "            print('probe', r.status, r.read().decode().replace(chr(10), ' ')); break\n"
         "    except OSError:\n"
         "        time.sleep(1)\n"
         "else:\n"
         "    sys.exit('the dashboard agent never answered /api/healthz')\n"
         "with urllib.request.urlopen('" + DASHBOARD + "/api/gcs_healthz', timeout=10) as r:\n"
         "    print('gcs', r.status, r.read().decode())\n")
ENTRYPOINT = "gpupool simulate sweep --grid /work/grid.yaml --out /work/job --ray auto"
# ray-operator/controllers/ray/common/job.go BuildJobSubmitCommand, K8sJobMode, run by `/bin/bash -ce --`
SUBMITTER = (
    "until python -c \"import urllib.request; r=urllib.request.urlopen('" + DASHBOARD + "/api/gcs_healthz',"
    " timeout=10); exit(0 if b'success' in r.read() else 1)\" >/dev/null 2>&1 ; do echo waiting ; sleep 2 ; done ;"
    f" if ! ray job status --address {DASHBOARD} {JOB_ID} >/dev/null 2>&1 ; then"
    f" ray job submit --address {DASHBOARD} --no-wait --submission-id {JOB_ID} -- {ENTRYPOINT} ; fi ;"
    f" ray job logs --address {DASHBOARD} --follow {JOB_ID}")
SCRIPT = f"""
set -e
({HEAD}) >/tmp/head.log 2>&1 &
python /work/probe.py || {{ cat /tmp/head.log; exit 1; }}
gpupool simulate sweep --grid /work/grid.yaml --out /work/driver --ray auto
/bin/bash -ce -- "$(cat /work/submit.sh)"
ray job status --address {DASHBOARD} {JOB_ID} >/tmp/status.txt 2>&1
grep -q "Job '{JOB_ID}' succeeded" /tmp/status.txt && echo "ray job status: SUCCEEDED"
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bundle]:
    require_or_skip(missing_for_runc(RAY_ARCHIVE))
    path = tmp_path_factory.mktemp("bundle")
    image = unpack(RAY_ARCHIVE, path / "rootfs")
    yield Bundle(path, image)


def test_the_image_holds_ray_with_its_dashboard_and_what_kuberay_execs(bundle: Bundle) -> None:
    code = ("import ray, ray.dashboard, aiohttp_cors, opencensus, gpupool_sched.simulate.sweep_ray;"
            "import importlib.util as u; print(ray.__version__, u.find_spec('pip'), u.find_spec('matplotlib'))")
    done = bundle.run("/bin/bash", "-c", 'command -v python ray gpupool; python -c "$0"', code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["/opt/gpupool/bin/python", "/opt/gpupool/bin/ray", "/opt/gpupool/bin/gpupool"]
    assert lines[3].endswith(" None None"), lines  # no pip, no matplotlib
    lock = (Path(__file__).resolve().parents[2] / "hack/image/requirements-ray.lock").read_text()
    assert f"\nray=={lines[3].split()[0]} " in lock  # the Ray version the manifest's rayVersion names


def test_a_ray_head_in_the_image_runs_the_sweep_and_kuberays_job_submission(bundle: Bundle, tmp_path: Path) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(GRID))
    local = tmp_path / "local"
    assert main(["simulate", "sweep", "--grid", str(grid), "--out", str(local), "--workers", "1"]) == 0
    work = tmp_path / "work"
    work.mkdir()
    (work / "grid.yaml").write_text(grid.read_text())
    (work / "probe.py").write_text(PROBE)
    (work / "submit.sh").write_text(SUBMITTER)
    os.chown(work, 65532, 65532)
    mounts = [{"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "mode=1777", "size=1g"]},
              {"destination": "/work", "type": "bind", "source": str(work), "options": ["rbind", "rw"]}]
    done = bundle.run("/bin/bash", "-c", SCRIPT, mounts=mounts, timeout=420)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert "probe 200 raylet: success" in done.stdout, done.stdout
    assert "gcs 200 success" in done.stdout, done.stdout
    assert "sweep: 2 runs, 0 finished before (skipped), 2 run now" in done.stdout, done.stdout
    assert "ray job status: SUCCEEDED" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    names = sorted(p.name for p in (local / "runs").iterdir())
    assert len(names) == 2
    for where in ("driver", "job"):
        assert sorted(p.name for p in (work / where / "runs").iterdir()) == names, where
        for name in names:
            assert (work / where / "runs" / name).read_bytes() == (local / "runs" / name).read_bytes(), (where, name)
