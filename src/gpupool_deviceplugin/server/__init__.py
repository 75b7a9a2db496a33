"""gRPC side of the plugin: one DevicePlugin server per resource, registration, kubelet restarts."""
