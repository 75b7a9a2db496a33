# gpupool developer entry points. Everything runs from the repo's virtualenv (.venv).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
export GPUPOOL_CACHE ?= $(HOME)/.cache/gpupool

.PHONY: help venv simulate test test-unit test-e2e lint typecheck fmt bench bench-sim bench-deviceplugin \
        bench-cluster-infra bench-cluster bench-extender bench-quotas bench-preemption bench-bound bench-sweep bench-time proto cluster-bins cluster-up cluster-down demo demo-down clean \
        image node-images

help: ## list every target with its description (the `## ` comment on its line)
	@awk '/^[a-zA-Z][a-zA-Z0-9_-]*:([^=]|$$)/ { name = $$0; sub(/:.*/, "", name); \
	    desc = index($$0, "## ") ? substr($$0, index($$0, "## ") + 3) : "(no description)"; \
	    printf "  %-22s %s\n", name, desc }' $(MAKEFILE_LIST)

$(VPY): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	@touch $(VPY)

venv: $(VPY) ## create .venv and install gpupool with dev extras

simulate: $(VPY) ## main job: replay the bundled Alibaba trace with every policy (table, JSON, plot in out/)
	@mkdir -p out
	$(VENV)/bin/gpupool simulate --policy all --json out/simulate.json --plot out/simulate.png

test: $(VPY) cluster-bins ## lint + types + every test, e2e included (builds/starts the local control plane)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	$(VPY) -m pytest -q --durations=30  # the slowest tests, to keep CI under its time budget

test-unit: $(VPY) ## tests that need no control plane
	$(VPY) -m pytest -q -m 'not e2e'

test-e2e: $(VPY) cluster-bins ## only the tests against the real kube-apiserver + etcd + kwok
	$(VPY) -m pytest -q -m e2e

lint: $(VPY) ## ruff + mypy
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

typecheck: $(VPY) ## mypy over src, benchmarks and tests/support (strict for the placement core, gpupool_common, the scheduler's state)
	$(VENV)/bin/mypy

fmt: $(VPY) ## ruff --fix: apply ruff's automatic fixes to src, tests and benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

bench: $(VPY) ## all benchmarks: JSON + table in out/bench/
	$(MAKE) bench-sim bench-time bench-bound bench-sweep bench-deviceplugin bench-extender bench-quotas bench-preemption bench-cluster-infra bench-cluster

bench-sim: $(VPY) ## simulator wall time per policy + per-decision cost at 1k/5k/20k nodes
	$(VPY) -m benchmarks.bench_placement --out out/bench

bench-time: $(VPY) ## simulate --mode time: events/s per load on the bundled trace (one core), same seed same report
	$(VPY) -m benchmarks.bench_time --out out/bench

bench-bound: $(VPY) ## lower bound on unallocated GPUs per openb trace beside FGD and gpupool (needs ../shared/traces/openb)
	$(VPY) -m benchmarks.bench_bound --out out/bench

bench-sweep: $(VPY) ## `gpupool simulate sweep` on a paper-grid subset, local processes and a local Ray head; the full grid projected (needs ../shared/traces/openb)
	$(VPY) -m benchmarks.bench_sweep --out out/bench

bench-deviceplugin: $(VPY) ## device plugin ListAndWatch/Allocate latency and RSS
	$(VPY) -m benchmarks.bench_deviceplugin --out out/bench

bench-extender: $(VPY) ## extender's added latency per pod (filter + prioritize + bind over HTTP), 100 / 1000 nodes
	$(VPY) -m benchmarks.bench_extender --out out/bench

bench-quotas: $(VPY) ## GpuQuota admission: a check (10k pods, 50 quotas) and a freed GPU (500 over-quota pods), vs the full rescan
	$(VPY) -m benchmarks.bench_quotas --out out/bench

bench-preemption: $(VPY) ## one preemption plan at 1000 nodes x 8 pods: kube-scheduler's candidate sampling vs the full search
	$(VPY) -m benchmarks.bench_preemption --out out/bench

bench-cluster-infra: $(VPY) cluster-bins ## 1000 fake GPU nodes + 10k pods: bring-up time and memory
	$(VPY) -m benchmarks.bench_cluster_infra --out out/bench

bench-cluster: $(VPY) cluster-bins ## gpupool vs kube-scheduler, 1000 nodes x 8 GPUs, 10k pods: pods/s, latency, RSS
	$(VPY) -m benchmarks.bench_cluster --out out/bench

proto: $(VPY) ## regenerate the kubelet device plugin v1beta1 stubs from proto/
	$(VPY) hack/gen_proto.py

cluster-bins: ## build kube-apiserver/scheduler/controller-manager, kubelet/kube-proxy, kwok, helm, the devicemanager harness (cached by version)
	bash hack/cluster/build-bins.sh

cluster-up: $(VPY) cluster-bins ## start etcd + kube-apiserver + kwok on 127.0.0.1 (reuses a running one)
	bash hack/cluster/up.sh

cluster-down: $(VPY) ## stop the local control plane (by pid)
	bash hack/cluster/down.sh

demo: $(VPY) cluster-bins ## the chart on the local control plane (as pods on a real node where the machine can), a mixed workload, `gpupool status` before and after, the scheduler's metrics
	$(VPY) hack/demo.py up

demo-down: $(VPY) ## remove everything `make demo` made (processes, chart, namespace, nodes; the cluster if it started it)
	$(VPY) hack/demo.py down

image: $(VPY) ## (root) OCI images gpupool:<version> and gpupool-ray:<version> (+ Ray: the sweep's RayJob) from Debian packages + pause and workload images: out/image/, imported into /run/containerd's containerd when it runs
	@if [ "$$(id -u)" != 0 ]; then echo "make image: needs root (mmdebstrap and chroot build the image's root file system): sudo make image" >&2; exit 1; fi
	@command -v mmdebstrap >/dev/null || { echo "make image: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
	$(VPY) hack/image/build.py

node-images: $(VPY) ## only the dev node's small images: registry.k8s.io/pause:3.10 and gpupool-workload:<version> (static C, out/image/)
	$(VPY) hack/image/build.py --node-images-only

clean: ## remove out/, build artefacts and tool caches
	rm -rf out build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache
