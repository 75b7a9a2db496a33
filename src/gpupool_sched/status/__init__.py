"""`gpupool status` / `kubectl gpupool status`: what every GPU of the pool holds, what waits, and how
fragmented the pool is, read once from the API server with read-only rights (docs/status.md).

    model.py    the report (pydantic; `--output json` is its JSON, field names are stable)
    collect.py  listed nodes, pods and PriorityClasses -> the report, through the scheduler's own
                ClusterState (same snapshot, same annotation handling) and the core's FGD measure
    render.py   the report -> a table for 80 columns
    cli.py      the sub-command, the `kubectl-gpupool` entry point, API errors as one line
"""
