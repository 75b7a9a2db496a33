"""Registering resources with the kubelet (Registration service on kubelet.sock)."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc

from gpupool_deviceplugin.api.v1beta1 import api_pb2, api_pb2_grpc

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


class KubeletRegistrar:
    """One channel to kubelet.sock, reused for every Register call until `reset()` (kubelet restart).
    Closing a gRPC channel blocks for a while, so old channels are closed on a background thread."""

    def __init__(self, kubelet_dir: Path, timeout_s: float = 5.0) -> None:
        self.target = f"unix://{kubelet_dir / KUBELET_SOCKET}"
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None

    def register(self, resource_name: str, endpoint: str) -> None:
        """One Register call (waiting up to the timeout for the socket to accept); raises grpc.RpcError."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.target)
        try:
            api_pb2_grpc.RegistrationStub(self._channel).Register(
                api_pb2.RegisterRequest(
                    version=API_VERSION,
                    endpoint=endpoint,
                    resource_name=resource_name,
                    options=api_pb2.DevicePluginOptions(pre_start_required=False,
                                                        get_preferred_allocation_available=True),
                ),
                timeout=self.timeout_s,
                wait_for_ready=True,
            )
        except grpc.RpcError:
            self.reset()
            raise

    def reset(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            threading.Thread(target=channel.close, name="close-kubelet-channel", daemon=True).start()
