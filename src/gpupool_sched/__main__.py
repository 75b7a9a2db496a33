"""`python -m gpupool_sched`: the scheduler service (same flags as `gpupool scheduler`)."""

import sys

from gpupool_sched.scheduler.cli import main

sys.exit(main())
