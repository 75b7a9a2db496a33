"""Cluster-state ingestion that the scheduler and the extender share, around the ledger itself
(scheduler/state.py): the start-up sync and the readiness that waits for it (sync.py), node events
(nodes.py), and the workload profile with the placement policy built for it (policy.py)."""
