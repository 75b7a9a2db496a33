"""Writes to the API server: Bindings, evictions and nominations, Events and PodScheduled conditions, each
through its lane of API threads (`apiwriter`)."""
