"""gpupool scheduler side: placement core, simulator, scheduler service and extender."""

__version__ = "0.1.0"
