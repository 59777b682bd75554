"""GPU utilisation of exactly the GPUs Ray assigned to this process.

:class:`NvmlGpuSource` reads NVML (``nvidia-ml-py``) for the GPU ids in
``ray.get_gpu_ids()`` (the replica's, or its TP workers' when they report).
On a machine without NVML it reports itself unavailable with the reason;
nothing raises. :class:`GpuUtilSmoother` samples a source on an interval and
keeps an exponential moving average, because NVML's utilisation is a
duty-cycle reading over the last sample period and jumps between 0 and 100
under light load.

:class:`FakeGpuUtilSource` is a **fake** for CPU-only machines (CI, laptops):
it reports ``busy_pct`` while the engine has running requests and ``idle_pct``
otherwise. It exists only to exercise the autoscaler where NVML cannot run.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("seekserve.gpu")


@dataclass
class GpuSample:
    util_pct: float  # mean over the assigned GPUs
    memory_used_bytes: int
    memory_total_bytes: int
    per_gpu_util_pct: tuple[float, ...]


class GpuSource:
    name = "base"

    def sample(self) -> GpuSample | None:
        """A reading, or None when unavailable (see :attr:`unavailable_reason`)."""
        raise NotImplementedError

    unavailable_reason: str | None = None


class NvmlGpuSource(GpuSource):
    name = "nvml"

    def __init__(self, gpu_ids: list | None = None):
        self._handles = []
        self.unavailable_reason = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            if gpu_ids is None:
                gpu_ids = _ray_gpu_ids()
            if not gpu_ids:
                self.unavailable_reason = "no GPU is assigned to this process"
                return
            for gid in gpu_ids:
                if isinstance(gid, str) and gid.startswith("GPU-"):
                    self._handles.append(pynvml.nvmlDeviceGetHandleByUUID(gid))
                else:
                    self._handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(gid)))
        except Exception as e:  # NVMLError_LibraryNotFound on CPU machines, etc.
            self.unavailable_reason = f"NVML unavailable: {type(e).__name__}: {e}"
            self._handles = []

    def sample(self) -> GpuSample | None:
        if not self._handles:
            return None
        try:
            utils, used, total = [], 0, 0
            for h in self._handles:
                utils.append(float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu))
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
                used += int(mem.used)
                total += int(mem.total)
            return GpuSample(sum(utils) / len(utils), used, total, tuple(utils))
        except Exception as e:
            self.unavailable_reason = f"NVML read failed: {e}"
            return None


class FakeGpuUtilSource(GpuSource):
    """FAKE GPU source for machines without NVML: busy while requests run."""

    name = "fake"

    def __init__(self, is_busy: Callable[[], bool], busy_pct: float, idle_pct: float):
        self._is_busy = is_busy
        self.busy_pct = busy_pct
        self.idle_pct = idle_pct

    def sample(self) -> GpuSample | None:
        u = self.busy_pct if self._is_busy() else self.idle_pct
        return GpuSample(u, 0, 0, (u,))


class NoGpuSource(GpuSource):
    name = "none"
    unavailable_reason = "GPU utilisation disabled by config"

    def sample(self) -> GpuSample | None:
        return None


def _ray_gpu_ids() -> list:
    try:
        import ray

        return list(ray.get_gpu_ids())
    except Exception:
        return []


def make_gpu_source(spec: str, is_busy: Callable[[], bool]) -> GpuSource:
    """``nvml`` | ``none`` | ``fake:<busy_pct>:<idle_pct>`` (the fake is for CPU-only tests)."""
    if spec == "nvml":
        return NvmlGpuSource()
    if spec == "none":
        return NoGpuSource()
    if spec.startswith("fake:"):
        busy, idle = (float(x) for x in spec.split(":")[1:3])
        return FakeGpuUtilSource(is_busy, busy, idle)
    raise ValueError(f"unknown GPU source {spec!r}; valid: nvml, none, fake:<busy>:<idle>")


class GpuUtilSmoother:
    """Samples a source every ``interval_s`` and keeps an EMA of utilisation."""

    def __init__(self, source: GpuSource, interval_s: float = 1.0, alpha: float = 0.3):
        self.source = source
        self.interval_s = interval_s
        self.alpha = alpha
        self.util_pct: float | None = None
        self.last: GpuSample | None = None
        self._task: asyncio.Task | None = None

    def update(self) -> None:
        s = self.source.sample()
        self.last = s
        if s is None:
            self.util_pct = None
            return
        self.util_pct = s.util_pct if self.util_pct is None else (
            self.alpha * s.util_pct + (1 - self.alpha) * self.util_pct
        )

    def start(self) -> None:
        async def loop():
            while True:
                self.update()
                await asyncio.sleep(self.interval_s)

        self._task = asyncio.get_running_loop().create_task(loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
