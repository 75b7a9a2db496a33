"""Writes to the API server: Bindings, evictions and nominations, Events and PodScheduled conditions, GpuQuota
and PodGroup status (`status`), each through its lane of API threads (`apiwriter`)."""
