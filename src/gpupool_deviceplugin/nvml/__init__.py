"""NVML access: one narrow interface (`NvmlSession`) over either the real `pynvml` module or `FakeNvml`."""

from gpupool_deviceplugin.nvml.session import NvmlSession, open_fake, open_real

__all__ = ["NvmlSession", "open_fake", "open_real"]
