"""The benchmark artifact: ``data/benchmark/NAME/benchmark.json`` and its two DVC metrics
(``data/metrics/bench-NAME.json``), one owner.

benchmark@NAME writes it (``pipeline.bench`` measures); report and publish read it through ``read``. Torch-free,
so that the stages that only present the figures never import torch. A rolled-back variant is not benchmarked,
and its record says why; so does ``read`` when the stage has not run yet (decide runs before the benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from pipeline import paths
from pipeline.artifacts.record import Record
from pipeline.errors import UserError
from pipeline.files import read_json, write_json
from pipeline.present import verdict

FILE = "benchmark.json"

FP32, TF32, AMP, FP32_AGAIN = "fp32", "tf32", "amp", "fp32_again"
"""The arms measured (``pipeline.bench.arms``): strict FP32, TF32 where the GPU has it, the variant's policy, and strict
FP32 again (the A/A arm: the same FP32 update on a model of its own, timed in the same rounds, whose ratio to ``fp32``
is the timing's own noise). They key every per-arm mapping of the record."""

FASTER, SLOWER, NO_DIFFERENCE = "faster", "slower", "no measurable difference"
SpeedVerdict = Literal["faster", "slower", "no measurable difference"]
"""What the benchmark says of AMP's speed (``pipeline.bench.stats.speed_verdict`` decides it)."""


@dataclass(frozen=True)
class Spread(Record):
    """Median and spread of measured values (nearest-rank quantiles: the median is a value that was measured)."""

    median: float
    q1: float
    q3: float
    iqr: float
    rel_iqr: float
    """IQR relative to the median (inf for a zero median)."""
    min: float
    max: float
    n: int


@dataclass(frozen=True)
class Interval(Record):
    """A confidence interval for the median of per-round ratios (``pipeline.bench.stats.median_interval``)."""

    median: float
    """The nearest-rank median, as in ``Spread``."""
    low: float
    high: float
    """-inf and inf when the rounds are too few for any interval at ``level`` (fewer than 6 for 95 %)."""
    level: float
    """The confidence asked for (0.95)."""
    coverage: float
    """The exact coverage of [low, high] (at least ``level``; 1 for an unbounded interval)."""
    n: int


NEVER = "never reached"
QualityVerdict = Literal["faster", "slower", "no measurable difference", "never reached"]
"""What the benchmark says of AMP's time to FP32's final loss (``pipeline.bench.stats.time_to_quality`` decides it)."""


@dataclass(frozen=True)
class TimeToQuality(Record):
    """AMP's time to reach FP32's final loss against FP32's: its updates to get there (compare's
    ``training.updates_to_fp32_loss``) times its time per step, over FP32's (``pipeline.bench.stats.time_to_quality``).
    Below 1, AMP gets there sooner: a step 2x faster that needs 2.5x the updates gets there later (1.25)."""

    ABSENT = ("ratio", "low", "high")

    verdict: QualityVerdict
    """``faster`` when the whole interval lies below 1, ``slower`` above; ``never reached`` when AMP's run did not get
    there (no claim to quality then)."""
    target: float
    """FP32's final loss (the reference's mean loss over its last steps)."""
    amp: int | None
    """AMP's real updates to reach ``target``; None: never."""
    of: int
    """AMP's real updates in all."""
    fp32: int | None
    """The reference's, by the same rule."""
    fp32_replicates: tuple[int | None, ...]
    """Each FP32 replicate's (another data order; None: never within its run): FP32's own spread."""
    ratio: float | None
    """(AMP's steps to ``target`` x AMP's time per step) / (FP32's x FP32's), at the median speedup."""
    low: float | None
    high: float | None
    method: str

    def words(self) -> str:
        """``time to FP32's final loss: x0.80 (0.70-0.95; AMP needed 150 of 150 updates, FP32 150; FP32's replicates
        140-150)``, or ``never reached FP32's final loss in 150 updates (...): no time-to-quality claim``
        (``present.verdict.to_quality_words``: the one wording)."""
        return verdict.to_quality_words(self)


@dataclass(frozen=True)
class Speed(Record):
    """AMP's speed judged against the timing's own noise: FP32 / AMP beside FP32 / FP32 again (the A/A), per round."""

    verdict: SpeedVerdict
    """``faster`` only if the speedup's interval lies above 1 and above the A/A's; ``slower`` symmetrically."""
    speedup: Interval
    """FP32 time / AMP time, per round."""
    fp32_again: Interval
    """FP32 time / FP32-again time, per round: what a speedup of nothing looks like on this machine."""
    method: str
    to_quality: TimeToQuality | None = None
    """AMP's time to FP32's final loss against FP32's (absent where compare recorded no updates to it)."""

    ABSENT = ("to_quality",)

    def words(self) -> str:
        """The verdict with its figures, then the time to quality's (``present.verdict.speed_line``: the one wording)."""
        return verdict.speed_line(self)

    def per_step_words(self) -> str:
        """The verdict on the time per step with its figures, without the time to quality."""
        return verdict.per_step_words(self)


@dataclass(frozen=True)
class MemoryProbe(Record):
    """One variant's peak-memory rounds, in bytes (one value per round)."""

    peak: tuple[float, ...]
    """Max allocated on a GPU, peak resident set on the CPU."""
    baseline: tuple[float, ...]
    """The same measure just before the round: weights, optimizer state, batch (NaN where it cannot be read)."""
    skipped: tuple[int, ...]
    """Updates the scaler skipped in the round (a skipped update allocates no optimizer state)."""
    method: str

    def kept_rounds(self) -> list[int]:
        """Rounds without a skipped update: the only ones whose peak is compared."""
        return [r for r, s in enumerate(self.skipped) if not s]


@dataclass(frozen=True)
class WorkloadFacts(Record):
    """What was trained: the trial's first update, with the trial's model, batch and policy."""

    model: str
    options: dict[str, Any]
    parameters: int
    batch_size: int
    micro_batches: int
    input_shape: tuple[int, ...]
    fp32_modules: tuple[str, ...]
    initial_grad_scaler: Any
    """The GradScaler state AMP started from, or why there is none."""


@dataclass(frozen=True)
class Method(Record):
    """How it was measured: enough to judge the figures without reading the code."""

    ABSENT = ("timed", "fsdp")

    warmup: int
    repeats: int
    steps_per_repeat: int
    sizing: str
    clock: str
    order: str
    fp32: str
    tf32: str
    memory: str
    skipped_updates: str
    cpu_threads: int
    cpu_load_1min: float | None
    """Other processes on the CPU slow multi-threaded steps unevenly: read wide IQRs in that light."""
    timed: str | None = None
    """What one step is, where it is not a training update (an inference-only verdict times a forward pass)."""
    fsdp: str | None = None
    """Under ``distributed.strategy: fsdp``: how FSDP2 sharded every arm, as the trials train, and the dtype of the amp
    arm's parameters in its forward (``bfloat16`` under FSDP2's mixed precision)."""


@dataclass(frozen=True)
class RoundsDropped(Record):
    timed: tuple[int, ...]
    """Timed rounds in which any variant skipped an update: dropped for every variant."""
    skipped_updates: dict[str, tuple[int, ...]]
    """Per variant that skipped any, its skipped updates per round."""


@dataclass(frozen=True)
class Samples(Record):
    """Every value measured, before any summary."""

    seconds_per_step: dict[str, tuple[float, ...]]
    memory: dict[str, MemoryProbe]


@dataclass(frozen=True)
class MemorySummary(Record):
    """Peak and working memory (peak minus baseline) per variant, and the AMP / FP32 ratios of both."""

    ABSENT = ("memory_rounds_dropped", "memory_ratio", "working_memory_ratio")  # readers that find a figure can trust it

    peak_memory_bytes: dict[str, Spread]
    working_memory_bytes: dict[str, Spread]
    memory_rounds_dropped: dict[str, tuple[int, ...]] | None
    """Per variant that had any, the memory rounds dropped for a skipped update (None when none)."""
    memory_ratio: Spread | None
    working_memory_ratio: Spread | None


@dataclass(frozen=True)
class Benchmark(Record):
    """An accepted variant's figures: time per step and memory, FP32 (and TF32) against AMP."""

    benchmarked: ClassVar[bool] = True
    variant: str
    env: dict[str, Any]
    workload: WorkloadFacts
    method: Method
    rounds_dropped: RoundsDropped
    samples: Samples
    memory: MemorySummary
    """Written at the top level of the file, beside the timings."""
    seconds_per_step: dict[str, Spread] | None
    """None when every timed round was dropped (then ``no_speedup_because`` says why)."""
    speedup: Spread | None
    """FP32 time / AMP time, per round; None with the timings. Its words are ``speed``'s."""
    speedup_vs_tf32: Spread | None
    """TF32 time / AMP time, where the GPU has TF32."""
    no_speedup_because: str | None
    compile_seconds: float | None = None
    """A compiled variant: what its first step spent compiling (dynamo and inductor, cold: without inductor's on-disk
    cache), apart from the step times."""
    speed: Speed | None = None
    """The speed verdict, its interval and the A/A's; None where no speedup is quoted (or a record older than the A/A)."""

    ABSENT = ("seconds_per_step", "speedup", "speedup_vs_tf32", "no_speedup_because", "compile_seconds", "speed")

    def as_dict(self) -> dict:
        """The memory figures sit at the top level of the file, after the timings."""
        top = {key: value for key, value in super().as_dict().items() if key != "memory"}
        return {"benchmarked": True, **top, **self.memory.as_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Benchmark:
        inner = {f.name for f in fields(MemorySummary)}
        memory = {key: value for key, value in d.items() if key in inner}
        rest = {key: value for key, value in d.items() if key not in inner and key != "benchmarked"}
        return super().from_dict({**rest, "memory": memory})

    def metrics(self) -> dict:
        """The DVC metrics: two numbers (``benchmark.json`` holds the rest)."""
        return {
            "speedup": self.speedup.median if self.speedup else None,
            "mem_ratio": self.memory.memory_ratio.median if self.memory.memory_ratio else None,
        }

    def summary_line(self) -> str:
        s, m, dropped = self.speedup, self.memory.memory_ratio, self.rounds_dropped.timed
        rounds = self.method.repeats - len(dropped)
        if self.speed:
            said = f"{self.speed.per_step_words()} over {rounds} rounds"
            said += f"; {self.speed.to_quality.words()}" if self.speed.to_quality else ""
        elif s:
            said = f"speed not judged: no interval recorded (median x{s.median:.2f}); rerun benchmark@{self.variant}"
        else:
            said = str(self.no_speedup_because)
        line = f"benchmark {self.variant}: {said}"
        if m:
            line += f", peak memory x{m.median:.2f} of FP32 (IQR {m.q1:.2f}-{m.q3:.2f})"
        if dropped:
            line += f"; {len(dropped)} round(s) dropped: the GradScaler skipped an update"
        if self.compile_seconds is not None:
            line += f"; compile {self.compile_seconds:.1f} s once, not in the step times"
        if self.env["backend"] == "cpu":
            line += " [CPU: a short run, not a GPU figure]"
        return line


@dataclass(frozen=True)
class NotBenchmarked(Record):
    """A variant with no figures, and why (rolled back, or the stage has not run)."""

    benchmarked: ClassVar[bool] = False
    variant: str
    reason: str

    def as_dict(self) -> dict:
        return {"benchmarked": False, **super().as_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> NotBenchmarked:
        return super().from_dict({key: value for key, value in d.items() if key != "benchmarked"})

    def metrics(self) -> dict:
        return {}

    def summary_line(self) -> str:
        return f"benchmark {self.variant}: skipped ({self.reason})"


Measured = Benchmark | NotBenchmarked


def rolled_back(variant: str) -> NotBenchmarked:
    return NotBenchmarked(variant, f"{variant} was rolled back; only accepted variants are benchmarked")


def write(record: Measured) -> None:
    write_json(paths.benchmark(record.variant) / FILE, record.as_dict())
    write_json(paths.benchmark_metrics(record.variant), record.metrics())


def read(variant: str) -> Measured:
    """The record of ``variant``; a missing file reads as not benchmarked, saying so.

    Raises:
        UserError: the file is damaged or is not a benchmark record.
    """
    path = paths.benchmark(variant) / FILE
    if not path.is_file():
        return NotBenchmarked(variant, f"{FILE} not found")
    raw = read_json(path, f"benchmark@{variant}")
    try:
        return from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(
            f"{path} is not a benchmark record ({exc!r}); regenerate it with `dvc repro -f benchmark@{variant}`"
        ) from None


def from_dict(raw: dict) -> Measured:
    """The record ``as_dict`` wrote (ValueError, KeyError or TypeError for anything else)."""
    return (Benchmark if raw["benchmarked"] else NotBenchmarked).from_dict(raw)
