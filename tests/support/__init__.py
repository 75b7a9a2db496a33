"""The test support package: every helper that more than one test module, a hack/ script or a benchmark
uses, one role per module. Test modules (`test_*.py`, `conftest.py`) import from here and never from one
another; tests/test_import_rules.py enforces it.

Why here, as `tests.support` (tests/ a package importable from the repo root), and not as a package under
src/: these helpers are for a checkout only. They drive things that exist only there (deploy/helm/gpupool,
out/image, the binaries `make cluster-bins` builds, hack/kubelet-harness) and need pytest, a dev
dependency; under src/ they would be found by setuptools' package discovery and ship in the wheel and the
container image to every user. From the repo root they import as they are: pytest (`pythonpath = ["."]`),
`python -m benchmarks.<name>`; hack/ scripts, run by path, put the repo root on sys.path. mypy checks
them (pyproject's `files`).

  waiting            polling for a condition (`eventually`)
  ports              a free port on 127.0.0.1
  kubeconfigs        kubeconfig files for a server of the test's choice
  objects            API objects as JSON, built by hand (nodes, pods, GpuQuotas, namespaces, assignments)
  clusters           hand-made clusters for the placement core (nodes, running pods for preemption)
  scheduler_state    the scheduler's ledger driven in-process (one cycle, free GPUs)
  apiserver          a scripted fake Kubernetes API (lost Binding answers, watch gaps)
  recording_server   an HTTP server recording the scheduler's writes, answering from a script
  kubelet_standin    the kubelet's device-manager side: Registration, plugin clients, admission, PodResources
  kubelet_harness    the real kubelet device manager (hack/kubelet-harness), driven over JSON lines
  plugin_process     the device plugin as a process (fake NVML), its logs and metrics
  node_kubelet       the kubelet of one node: watches its pods, admits them through the stand-in
  plugin_pool        nodes running the real plugin + kubelet stand-in + node kubelet, as one pool
  handshake_node     one node's pods bound by hand with an assignment, for the plugin's e2e tests
  scheduler_harness  `gpupool scheduler` as a process against the dev cluster, and what it did
  faultproxy         a fault-injecting HTTPS proxy between a scheduler replica and kube-apiserver
  chart              the Helm chart's programs run as local processes with the chart's identities
  image              the image `make image` builds, and skip-or-fail when it is missing
  realnode_cluster   dev clusters with real nodes (kubelet + containerd) and what is checked on them
  fixtures           the shared fixtures' bodies: a private dev cluster, a fresh namespace
"""
