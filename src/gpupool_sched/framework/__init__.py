"""The scheduling framework: what one decision may change (`statement`), built on the cluster state."""
