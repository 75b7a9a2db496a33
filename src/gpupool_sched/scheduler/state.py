"""The cluster state moved to `gpupool_sched.cache`; these names stay importable from here until the
layout step of issue 18 moves every importer."""

from gpupool_sched.cache.entries import CHECKPOINT_GRACE as CHECKPOINT_GRACE
from gpupool_sched.cache.entries import TERMINAL_PHASES as TERMINAL_PHASES
from gpupool_sched.cache.entries import Nomination as Nomination
from gpupool_sched.cache.entries import Phase as Phase
from gpupool_sched.cache.entries import PodEntry as PodEntry
from gpupool_sched.cache.entries import PodUpdate as PodUpdate
from gpupool_sched.cache.entries import plan_shapes as plan_shapes
from gpupool_sched.cache.state import ClusterState as ClusterState
