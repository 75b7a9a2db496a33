"""Plugins the actions ask: gangs (job-ready: minMember), GpuQuota (admission and reclaim candidates),
victims (who may preempt, which pods are candidates, PodDisruptionBudgets, eviction grace)."""
