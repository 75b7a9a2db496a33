"""gpupool device plugin: makes a node's GPUs, MIG devices and GPU-memory units schedulable.

Runs as a DaemonSet next to the kubelet and speaks the kubelet device plugin API v1beta1.
"""

__version__ = "0.1.0"
