"""What a container gets from Allocate: visible devices, CDI devices and, for shares, its memory budget."""

from __future__ import annotations

from collections.abc import Sequence

from gpupool_deviceplugin.api.v1beta1 import api_pb2
from gpupool_deviceplugin.config import PluginConfig
from gpupool_deviceplugin.resources import PluginDevice, ResourceSpec

ENV_VISIBLE = "NVIDIA_VISIBLE_DEVICES"
ENV_MEMORY_LIMIT = "GPUPOOL_MEMORY_LIMIT_MIB"
ENV_MEMORY_UNITS = "GPUPOOL_MEMORY_UNITS"
ENV_MPS_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_MPS_PIPE = "CUDA_MPS_PIPE_DIRECTORY"


def container_response(spec: ResourceSpec, devices: Sequence[PluginDevice],
                       config: PluginConfig) -> api_pb2.ContainerAllocateResponse:
    # a memory share names its GPU once, however many units it has
    targets = list(dict.fromkeys(d.mig_uuid or d.gpu_uuid for d in devices))
    resp = api_pb2.ContainerAllocateResponse()
    if config.cdi.enabled:
        names = [f"{config.cdi.kind}={t}" for t in targets]
        resp.cdi_devices.extend(api_pb2.CDIDevice(name=n) for n in names)
        resp.envs[ENV_VISIBLE] = ",".join(names)
    else:
        resp.envs[ENV_VISIBLE] = ",".join(targets)
    if spec.kind == "memory":
        mib = len(devices) * config.gpu_memory.unit_mib
        resp.envs[ENV_MEMORY_LIMIT] = str(mib)
        resp.envs[ENV_MEMORY_UNITS] = str(len(devices))
        if config.gpu_memory.mps:
            # the share is the only GPU the container sees, so it is CUDA device 0
            resp.envs[ENV_MPS_LIMIT] = f"0={mib}M"
            pipe = config.gpu_memory.mps_pipe_directory
            resp.envs[ENV_MPS_PIPE] = pipe
            resp.mounts.append(api_pb2.Mount(container_path=pipe, host_path=pipe, read_only=False))
            shm = config.gpu_memory.mps_shm_directory
            if shm:  # the client and its MPS server share memory here
                resp.mounts.append(api_pb2.Mount(container_path="/dev/shm", host_path=shm, read_only=False))
    return resp
