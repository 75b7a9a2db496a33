"""Plugins the actions ask: gangs (job-ready: minMember), GpuQuota (admission and reclaim candidates)."""
