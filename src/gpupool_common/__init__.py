"""What the device plugin and the scheduler share, so that neither imports the other.

topology.py    NodeTopology, PcieLevel: NVLink counts and PCIe levels between a node's GPUs
gpu_sets.py    topology score of a GPU set and the best set for a multi-GPU request (pure)
inventory.py   the node GPU inventory the plugin publishes and the scheduler parses (schema v1)
handshake.py   the assignment handshake's annotations and models (protocol v1)
kubeconfig.py  one checked kubeconfig loader for every command (a bad file is one line naming it)
clihelp.py     what every command line shares: help with defaults, one-line errors, log levels, UTF-8 errors

Needs only the core dependencies (pydantic, pyyaml, kubernetes); imports neither gpupool_sched nor
gpupool_deviceplugin (tests/unit/test_layout.py).
"""
