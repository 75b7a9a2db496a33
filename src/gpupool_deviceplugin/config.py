"""Device plugin configuration: a YAML file validated here. Unknown or malformed fields stop start-up
with a message naming the field (`ConfigError`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

from gpupool_common.clihelp import decode_utf8

# Xids caused by the application, not the GPU (NVIDIA's device plugin ignores the same set).
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class ResourcesConfig(_Section):
    """Which extended resources to advertise."""

    gpu: bool = True
    mig: bool = True
    gpu_memory: bool = True


class GpuMemoryConfig(_Section):
    unit_mib: int = Field(default=1024, ge=64, le=1 << 20, alias="unitMiB")
    mps: bool = False
    mps_pipe_directory: str = Field(default="/run/nvidia/mps", alias="mpsPipeDirectory")
    # the MPS daemon's /dev/shm on the host: its clients must share it (NVIDIA's MPS daemon keeps a
    # tmpfs at <root>/shm for that); "" leaves the container's own /dev/shm
    mps_shm_directory: str = Field(default="/run/nvidia/mps/shm", alias="mpsShmDirectory")

    @field_validator("mps_pipe_directory", "mps_shm_directory")
    @classmethod
    def _absolute(cls, v: str, info: ValidationInfo) -> str:
        if v and not v.startswith("/"):
            raise ValueError(f"an absolute host path, got {v!r}")
        if not v and info.field_name == "mps_pipe_directory":
            raise ValueError("MPS clients need the daemon's pipe directory")
        return v


class CdiConfig(_Section):
    enabled: bool = False
    kind: str = Field(default="nvidia.com/gpu", pattern=r"^[a-z0-9.-]+/[a-z0-9_.-]+$")


class HealthConfig(_Section):
    enabled: bool = True
    ignored_xids: tuple[int, ...] = Field(default=APPLICATION_XIDS, alias="ignoredXids")
    # A device marked unhealthy returns to Healthy after this long without new errors, if NVML
    # answers for it normally. 0 keeps it unhealthy until the plugin restarts (NVIDIA's behaviour).
    recovery_quiet_period_s: float = Field(default=300.0, ge=0, alias="recoveryQuietPeriodSeconds")
    event_wait_ms: int = Field(default=1000, ge=10, le=60_000, alias="eventWaitMs")

    @field_validator("ignored_xids")
    @classmethod
    def _positive(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(x <= 0 for x in v):
            raise ValueError("Xids are positive integers")
        return v


class MetricsConfig(_Section):
    port: int = Field(default=9402, ge=0, le=65535)  # 0: off, as --metrics-port 0 of every gpupool command
    # 127.0.0.1 like every gpupool listener by default; the Helm chart's config sets 0.0.0.0 (probes, Prometheus)
    bind_address: str = "127.0.0.1"


class KubernetesConfig(_Section):
    # auto: use in-cluster config or KUBECONFIG when present, else run without the API server
    # required: refuse to start without it; disabled: never talk to it
    mode: Literal["auto", "required", "disabled"] = "auto"
    publish_node: bool = True
    node_refresh_s: float = Field(default=300.0, gt=0, alias="nodeRefreshSeconds")


class IdleConfig(_Section):
    """Idleness per pod and GPU (docs/idle-and-elastic.md); the --idle-* flags override these."""

    sample_interval_s: float = Field(default=10.0, ge=0, alias="sampleIntervalSeconds")  # 0: not measured
    window_s: float = Field(default=600.0, gt=0, alias="windowSeconds")
    threshold_percent: float = Field(default=1.0, ge=0, le=100, alias="thresholdPercent")
    memory_change_percent: float = Field(default=1.0, ge=0, le=100, alias="memoryChangePercent")
    start_grace_s: float = Field(default=300.0, ge=0, alias="startGraceSeconds")
    # the idle-pods node annotation is patched on change, at most once per this
    publish_interval_s: float = Field(default=30.0, ge=0, alias="publishIntervalSeconds")
    # where /proc/<pid>/cgroup of GPU processes is read (pid -> pod); needs the host's PID namespace
    proc_root: str = Field(default="/proc", alias="procRoot")


class PluginConfig(_Section):
    version: Literal["v1"] = "v1"
    mig_strategy: Literal["none", "single", "mixed"] = "mixed"
    resources: ResourcesConfig = ResourcesConfig()
    gpu_memory: GpuMemoryConfig = GpuMemoryConfig()
    cdi: CdiConfig = CdiConfig()
    health: HealthConfig = HealthConfig()
    metrics: MetricsConfig = MetricsConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    idle: IdleConfig = IdleConfig()


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the field."""


def read_yaml(path: Path, what: str) -> object:
    """A YAML file's data; every way it can fail is one line naming ``what`` and the file (and the
    line for syntax errors) in a ConfigError."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory, not a YAML file")
    try:
        text, where = decode_utf8(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if text is None:
        raise ConfigError(f"{what} {path} is not UTF-8 text at {where} (a binary file?)")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} is not valid YAML: nested too deeply") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: the problem and where."""
    problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    position = getattr(exc, "position", None)  # ReaderError: a character YAML does not allow
    return f"{problem} (at character {position})" if position is not None else str(problem)


def load_config(path: str | Path | None) -> PluginConfig:
    if path is None:
        return PluginConfig()
    path = Path(path)
    return parse_config(read_yaml(path, "config file"), origin=str(path))


def parse_config(data: object, origin: str = "config") -> PluginConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return PluginConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"{origin}: field {where}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None
