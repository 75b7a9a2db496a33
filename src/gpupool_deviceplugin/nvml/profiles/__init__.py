"""Fake node descriptions shipped with gpupool (YAML, loaded by gpupool_deviceplugin.nvml.profile)."""
