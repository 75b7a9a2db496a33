"""Kubernetes wiring shared by the scheduler and the extender: the connection to the API server
(connection.py), the flags their commands share (cli_args.py) and the kopf operator that feeds their
watches (watch.py)."""
