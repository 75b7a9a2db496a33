"""A real local Kubernetes control plane for tests, demos and benchmarks (docs/dev-cluster.md).

Developer tooling, not part of the scheduler or the device plugin: it may import both (fake nodes are the
plugin's publication of a fake NVML profile); neither imports it. Needs the `dev` extra.

binaries.py    where the Go-built parts and etcd are; versions read from hack/cluster/gomod/*/go.mod
layout.py      one cluster's files (kubeconfig, pki, pid files, logs) and its state.json
pki.py         local CA, apiserver serving cert, service-account keys, bearer tokens
process.py     background processes tracked by pid + start time
components.py  each process's command line (127.0.0.1 only) and readiness probe
cluster.py     DevCluster: up (or reuse), down, status
kubeconfig.py  kubeconfig files and a Python client
raw.py         undecoded API responses for bulk calls
fake_nodes.py  kwok nodes from the device plugin's publication of a fake NVML profile
fake_pods.py   pods for those nodes (`gpupool.io/run-for`)
client.py      ClusterClient: what the `kube` pytest fixture and the benchmark use
cli.py         `gpupool dev-cluster ...`
kwok-config.yaml, kwok-stages.yaml   kwok's settings and Stages
"""
