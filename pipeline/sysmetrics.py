"""GPU system metrics of a stage's run (utilisation, memory, power), sampled beside it, for MLflow's System metrics tab.

MLflow's own ``log_system_metrics=True`` samples inside an active run, and the stages never talk to MLflow (publish
mirrors their outputs later, ``pipeline.tracking``). So a stage samples here, with MLflow's names and monitors' units
(``system/gpu_0_utilization_percentage``, ``system/gpu_0_memory_usage_megabytes``...: its GPUMonitor through pynvml
on NVIDIA, its ROCMMonitor through pyrsmi on ROCm), and writes the samples, with their wall-clock times, to a side
file outside DVC's outputs (``paths.system_metrics``): samples differ at every run, and the outputs must not. Publish
logs the file into the variant's run.

Every GPU the library sees is sampled, as MLflow's monitors do. On the CPU, or where the library is missing or
finds no GPU, nothing is sampled and no file is written: nothing fails for want of a monitor. Torch-free: publish
reads the files through ``read``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

from pipeline.artifacts.record import Record
from pipeline.errors import UserError
from pipeline.files import check_inside_repository, read_json, write_json

PREFIX = "system/"
"""MLflow's prefix of system metrics: its UI shows them in the run's System metrics tab, drawn against time."""
INTERVAL_S = 1.0
"""Seconds between two samples (MLflow's monitor defaults to 10 s: a trial of a minute would get six points)."""


class Backend(Protocol):
    """A GPU monitoring library, opened: one sample of every GPU it sees, per call."""

    name: str

    def read(self) -> dict[str, float]:
        """Metric name (MLflow's, without ``PREFIX``) -> value; a metric the GPU does not report is left out."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Sample(Record):
    timestamp_ms: int
    """Wall clock, ms since the epoch: MLflow draws system metrics against it."""
    metrics: dict[str, float]
    """Full MLflow names (``PREFIX`` included) -> value."""


@dataclass(frozen=True)
class Samples(Record):
    """The side file of one stage's run."""

    backend: str
    interval_s: float
    samples: tuple[Sample, ...]


class Nvml:
    """NVIDIA's management library (``pynvml``, from the ``nvidia-ml-py`` package), as MLflow's GPUMonitor reads it."""

    name = "nvml"

    def __init__(self) -> None:
        """Raises: ImportError without nvidia-ml-py; pynvml.NVMLError without a driver or a GPU."""
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        nv = self.nvml
        for i, handle in enumerate(self.handles):
            with contextlib.suppress(nv.NVMLError):
                memory = nv.nvmlDeviceGetMemoryInfo(handle)
                out[f"gpu_{i}_memory_usage_percentage"] = round(memory.used / memory.total * 100, 1)
                out[f"gpu_{i}_memory_usage_megabytes"] = memory.used / 1e6
            with contextlib.suppress(nv.NVMLError):
                out[f"gpu_{i}_utilization_percentage"] = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
            with contextlib.suppress(nv.NVMLError):  # some boards report no power
                milliwatts = nv.nvmlDeviceGetPowerUsage(handle)
                out[f"gpu_{i}_power_usage_watts"] = milliwatts / 1000
                out[f"gpu_{i}_power_usage_percentage"] = milliwatts / nv.nvmlDeviceGetEnforcedPowerLimit(handle) * 100
        return out

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


class Rocm:
    """AMD's ROCm SMI library (``pyrsmi``), as MLflow's ROCMMonitor reads it (its names: memory in gigabytes). pyrsmi
    answers -1 where a reading failed: left out. No power percentage: MLflow's assumes a 500 W board."""

    name = "rocm-smi"

    def __init__(self) -> None:
        """Raises: ImportError without pyrsmi; RuntimeError (or pyrsmi's own errors) without a driver."""
        from pyrsmi import rocml

        rocml.smi_initialize()
        self.rocml = rocml
        self.count = max(rocml.smi_get_device_count(), 0)

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        smi = self.rocml
        for i in range(self.count):
            used, total = smi.smi_get_device_memory_used(i), smi.smi_get_device_memory_total(i)
            if used >= 0 and total > 0:
                out[f"gpu_{i}_memory_usage_percentage"] = round(used / total * 100, 1)
                out[f"gpu_{i}_memory_usage_gigabytes"] = used / 1e9
            if (busy := smi.smi_get_device_utilization(i)) >= 0:
                out[f"gpu_{i}_utilization_percentage"] = float(busy)
            if (watts := smi.smi_get_device_average_power(i)) >= 0:
                out[f"gpu_{i}_power_usage_watts"] = float(watts)
        return out

    def close(self) -> None:
        self.rocml.smi_shutdown()


_LIBRARIES = {"cuda": (Nvml, "nvidia-ml-py"), "rocm": (Rocm, "pyrsmi")}


def open_backend(device_backend: str) -> Backend | None:
    """The monitor of ``device_backend`` (``devices.backend``: cpu, cuda, rocm), or None: on the CPU, or where its
    library is missing (one line says which to install) or cannot start (no driver, no GPU)."""
    if device_backend not in _LIBRARIES:
        return None
    kind, package = _LIBRARIES[device_backend]
    try:
        return kind()
    except ImportError:
        print(f"system metrics: none on this {device_backend} GPU run; `pip install {package}` logs them", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - any library failure means "no monitor", never a failed stage
        print(f"system metrics: none ({kind.name} did not start: {str(exc)[:200]})", file=sys.stderr)
    return None


class Sampler:
    """A daemon thread that samples ``backend`` every ``interval_s`` seconds: once at start, once at stop, so that
    even a run shorter than the interval has its two points. A reading that raises ends the sampling, never the run."""

    def __init__(self, backend: Backend, interval_s: float = INTERVAL_S) -> None:
        self.backend, self.interval_s = backend, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="system-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[Sample]:
        """Stop, take the last sample, close the backend; the samples in time order."""
        self._stop.set()
        self._thread.join()
        self._take()
        self.backend.close()
        return self.samples

    def _loop(self) -> None:
        while self._take() and not self._stop.wait(self.interval_s):
            pass

    def _take(self) -> bool:
        try:
            values = self.backend.read()
        except Exception as exc:  # noqa: BLE001 - a monitor that breaks midway costs its samples, not the stage
            print(f"system metrics: sampling stopped ({self.backend.name}: {str(exc)[:200]})", file=sys.stderr)
            return False
        if values:
            self.samples.append(Sample(int(time.time() * 1000), {PREFIX + k: float(v) for k, v in values.items()}))
        return True


@contextlib.contextmanager
def sampling(
    path: Path, device_backend: str, writes: bool = True, backend: Backend | None = None, interval_s: float = INTERVAL_S
) -> Iterator[None]:
    """Sample the GPUs while the block runs, and write the samples to ``path`` when it ends without error.

    ``path``'s earlier file is removed first, so that what publish finds always belongs to the stage's last run: a
    rerun on the CPU, or one that failed, leaves none. ``writes``: this process writes (rank 0 under torchrun); the
    other ranks neither sample nor touch the file. ``backend`` replaces the monitor ``open_backend`` picks.
    """
    if not writes:
        yield
        return
    path = Path(path)
    check_inside_repository(path.parent)  # no delete through a symlink (data/system-metrics linked elsewhere)
    path.unlink(missing_ok=True)
    monitor = backend if backend is not None else open_backend(device_backend)
    if monitor is None:
        yield
        return
    sampler = Sampler(monitor, interval_s)
    sampler.start()
    try:
        yield
    finally:
        samples = sampler.stop()
    if samples:
        write_json(path, Samples(monitor.name, interval_s, tuple(samples)).as_dict())


def read(path: Path) -> list[Sample]:
    """The samples of ``path`` in time order; none when the file is absent (a CPU run, or no library), and none, said
    in one line, when it is damaged: samples beside the results never stop their publishing."""
    if not Path(path).is_file():
        return []
    try:
        return list(Samples.from_dict(read_json(path)).samples)
    except (UserError, ValueError, TypeError, AttributeError) as exc:
        print(f"system metrics: {path} left out ({str(exc)[:200]}); rerun its stage to sample again", file=sys.stderr)
        return []
