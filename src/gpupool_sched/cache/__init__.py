"""The scheduler's cache: the ledger of pods on nodes, handshake gates, nominations, and the watch's
ingestion into them (kube-scheduler's cache and nominator)."""
