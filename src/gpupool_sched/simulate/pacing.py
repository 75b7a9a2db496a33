"""How pods arrive in time mode: a seeded Poisson stream whose offered load is a share ρ of the GPU capacity,
and the pods already running when the run starts (so that it starts in steady state).

Offered load. A pod asking for g GPUs (shares count fractionally) for L seconds offers g·L GPU-seconds.
Pods are drawn uniformly (with replacement) from the trace, so a Poisson stream of rate λ offers
λ·E[g·L] GPU-seconds per second; ρ of a cluster of C GPUs is λ = ρ·C / E[g·L].

Steady state. With lifetimes capped at the horizon H, every pod running at time 0 arrived in [-H, 0).
The same stream is drawn over [-H, 0) and the pods whose end lies after 0 are the pre-fill, each with its
residual lifetime: the stationary residual-life distribution of the stream at load ρ (exact for a cluster
where everything fits; the pre-fill is placed oldest first and what fits nowhere is dropped and counted).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from gpupool_sched.simulate.lifetimes import TimedPod

CHUNK = 4096


def gpu_seconds(pod: TimedPod) -> float:
    return pod.request.gpu_milli_total / 1000 * pod.lifetime_s


def arrival_rate(pods: Sequence[TimedPod], capacity_gpus: int, load: float) -> float:
    """Arrivals per second that offer `load` × `capacity_gpus` GPUs."""
    mean = sum(gpu_seconds(p) for p in pods) / len(pods)
    if mean <= 0:
        raise ValueError("no pod asks for GPU time")
    return load * capacity_gpus / mean


def poisson_arrivals(pods: Sequence[TimedPod], rate: float, rng: np.random.Generator, start: float,
                     end: float) -> Iterator[tuple[float, TimedPod]]:
    """(time, pod) in [start, end), exponential gaps of mean 1/rate, pods drawn uniformly."""
    t = start
    while True:
        gaps = rng.exponential(1.0 / rate, CHUNK)
        picks = rng.integers(len(pods), size=CHUNK)
        for gap, pick in zip(gaps.tolist(), picks.tolist(), strict=True):
            t += gap
            if t >= end:
                return
            yield t, pods[pick]


def prefill(pods: Sequence[TimedPod], rate: float, horizon_s: float,
            rng: np.random.Generator) -> list[tuple[TimedPod, float]]:
    """The pods running at time 0 and their residual lifetimes, oldest arrival first."""
    return [(pod, at + pod.lifetime_s) for at, pod in poisson_arrivals(pods, rate, rng, -horizon_s, 0.0)
            if at + pod.lifetime_s > 0]
