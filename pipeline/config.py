"""The typed configuration: params.yaml is read and validated here, once.

Every knob of the pipeline is a field below. Loading rejects unknown keys, wrong types and impossible
values with one line that names the key (``acceptance.outputs.logits.atol``) and says what to write
instead. Stages receive the ``Params`` object and never read params.yaml themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.errors import UserError

DTYPES = ("float16", "bfloat16")
_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class TaskConfig:
    kind: Literal["classification", "regression"] = "classification"
    """How outputs turn into decisions: argmax (classification) or error and threshold (regression)."""
    model: str = "pipeline.examples.digits:build_model"
    """``module:function`` returning a ``torch.nn.Module``; called with ``options``."""
    data: str = "pipeline.examples.digits:load_data"
    """``module:function`` returning train_x, train_y, eval_x, eval_y (and optional eval_ids)."""
    options: dict = field(default_factory=dict)
    """Keyword arguments given to both functions."""
    loss: Literal["cross_entropy", "mse"] = "cross_entropy"
    """Training loss; cross_entropy for classification, mse for regression."""

    def check(self, key: str) -> None:
        for name in ("model", "data"):
            value = getattr(self, name)
            if not _ENTRY_POINT.match(value):
                raise UserError(
                    f"params.yaml: {key}.{name} is {value!r}; write it as 'module:function', "
                    f"for example 'pipeline.examples.digits:build_model'"
                )
        expected = "cross_entropy" if self.kind == "classification" else "mse"
        if self.loss != expected:
            raise UserError(
                f"params.yaml: {key}.loss is {self.loss!r} but task.kind is {self.kind!r}; "
                f"use loss: {expected}"
            )


@dataclass(frozen=True)
class PrepareConfig:
    ordinary_cases: int = 256
    """How many evaluation samples enter the fixed set, in the order the data function gives them."""
    edge_scales: list[float] = field(default_factory=lambda: [1.0e-4, 100.0])
    """Each ordinary sample chosen for edge cases is also scaled by each factor (extreme magnitudes)."""
    edge_samples: int = 4
    """How many ordinary samples are scaled for edge cases."""

    def check(self, key: str) -> None:
        _positive(self.ordinary_cases, f"{key}.ordinary_cases")
        _non_negative(self.edge_samples, f"{key}.edge_samples")
        for i, s in enumerate(self.edge_scales):
            _positive(s, f"{key}.edge_scales[{i}]")


@dataclass(frozen=True)
class LrSchedule:
    kind: Literal["none", "step"] = "none"
    """``step`` multiplies the learning rate by ``gamma`` every ``every`` REAL updates."""
    every: int = 20
    """Real (not skipped) optimizer updates between two decays."""
    gamma: float = 0.5
    """Decay factor, in (0, 1]."""

    def check(self, key: str) -> None:
        _positive(self.every, f"{key}.every")
        if not 0 < self.gamma <= 1:
            raise UserError(f"params.yaml: {key}.gamma is {self.gamma}; use a factor in (0, 1]")


@dataclass(frozen=True)
class ReferenceConfig:
    train_steps: int = 60
    """Optimizer steps of the FP32 reference training (the trial repeats exactly these)."""
    batch_size: int = 64
    """Training batch size; batches are drawn in a fixed order from ``seed``."""
    optimizer: Literal["sgd", "adam"] = "sgd"
    """Optimizer used by the reference and the trial."""
    lr: float = 0.05
    """Learning rate."""
    momentum: float = 0.9
    """SGD momentum (ignored by adam)."""
    grad_clip: float | None = 1.0
    """Max total gradient norm, applied after ``unscale_``; null disables clipping."""
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    """Learning-rate schedule, driven by real updates."""
    eval_mode: bool = True
    """Run inference on the fixed set with ``model.eval()`` (true) or ``model.train()`` (false)."""
    checkpoint_every: int = 20
    """Save a resumable checkpoint every this many steps (0 disables)."""
    boundary_cases: int = 8
    """Decision-boundary cases built from the trained reference (classification only)."""
    boundary_epsilon: float = 1.0e-3
    """Bisection stops when the reference's top-2 margin is below this."""

    def check(self, key: str) -> None:
        _positive(self.train_steps, f"{key}.train_steps")
        _positive(self.batch_size, f"{key}.batch_size")
        _positive(self.lr, f"{key}.lr")
        _non_negative(self.momentum, f"{key}.momentum")
        if self.grad_clip is not None:
            _positive(self.grad_clip, f"{key}.grad_clip")
        _non_negative(self.checkpoint_every, f"{key}.checkpoint_every")
        _non_negative(self.boundary_cases, f"{key}.boundary_cases")
        _positive(self.boundary_epsilon, f"{key}.boundary_epsilon")
        self.lr_schedule.check(f"{key}.lr_schedule")


@dataclass(frozen=True)
class TrialConfig:
    dtypes: list[Literal["float16", "bfloat16"]] = field(default_factory=lambda: list(DTYPES))
    """Autocast dtypes to trial; each becomes one variant of every per-dtype stage."""
    fp32_modules: list[str] = field(default_factory=list)
    """Qualified module names run outside autocast (inputs cast to float32). A changed list is a new trial."""

    def check(self, key: str) -> None:
        if not self.dtypes:
            raise UserError(f"params.yaml: {key}.dtypes is empty; list at least one of {list(DTYPES)}")
        if len(set(self.dtypes)) != len(self.dtypes):
            raise UserError(f"params.yaml: {key}.dtypes lists a dtype twice; list each once")


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.05
    """Absolute tolerance: an element fails where |trial - ref| > atol + rtol * |ref|."""
    rtol: float = 0.02
    """Relative tolerance."""

    def check(self, key: str) -> None:
        _non_negative(self.atol, f"{key}.atol")
        _non_negative(self.rtol, f"{key}.rtol")


@dataclass(frozen=True)
class AcceptanceConfig:
    """The rule, fixed before any trial: its sha256 is frozen with the reference."""

    outputs: dict[str, Tolerance] = field(default_factory=lambda: {"*": Tolerance()})
    """Tolerances per named output; ``*`` applies to outputs not listed."""
    max_failing_fraction: float = 0.0
    """Largest fraction of output elements allowed outside tolerance, per output."""
    tie_rule: Literal["lowest_index", "tie_is_flip"] = "lowest_index"
    """Classification ties: take the lowest class index, or count any tie the reference lacks as a flip."""
    boundary_margin: float = 0.05
    """A case whose reference top-2 margin is below this is a boundary case."""
    max_flips: int = 0
    """Decision flips allowed among non-boundary cases."""
    max_boundary_flip_fraction: float = 1.0
    """Fraction of boundary cases allowed to flip (they are always listed)."""
    threshold: float | None = None
    """Regression only: decision threshold; crossing it is a flip."""
    min_quality: float | None = None
    """Minimum quality of the trial on the fixed set (accuracy, or -RMSE for regression); null: no minimum."""
    max_quality_drop: float = 0.01
    """Largest drop of quality versus the reference, inference and after training."""
    loss_rtol: float = 0.1
    """Training: per-step band |loss_amp - loss_fp32| <= loss_atol + loss_rtol * |loss_fp32|."""
    loss_atol: float = 0.05
    """Training: absolute part of the per-step loss band."""
    max_skipped_fraction: float = 0.1
    """Training: largest fraction of steps whose update the GradScaler skipped."""
    stall_window: int = 10
    """Training: updates stopped advancing if none of the last this many steps made a real update."""
    min_scale: float = 1.0
    """Training: updates stopped advancing if the final GradScaler scale is below this."""

    def check(self, key: str) -> None:
        if not self.outputs:
            raise UserError(f"params.yaml: {key}.outputs is empty; give at least '*': {{atol: ..., rtol: ...}}")
        for name, tol in self.outputs.items():
            tol.check(f"{key}.outputs.{name}")
        _fraction(self.max_failing_fraction, f"{key}.max_failing_fraction")
        _non_negative(self.boundary_margin, f"{key}.boundary_margin")
        _non_negative(self.max_flips, f"{key}.max_flips")
        _fraction(self.max_boundary_flip_fraction, f"{key}.max_boundary_flip_fraction")
        _non_negative(self.max_quality_drop, f"{key}.max_quality_drop")
        _non_negative(self.loss_rtol, f"{key}.loss_rtol")
        _non_negative(self.loss_atol, f"{key}.loss_atol")
        _fraction(self.max_skipped_fraction, f"{key}.max_skipped_fraction")
        _positive(self.stall_window, f"{key}.stall_window")
        _non_negative(self.min_scale, f"{key}.min_scale")

    def tolerance(self, output: str) -> Tolerance:
        return self.outputs.get(output, self.outputs.get("*", Tolerance()))

    def sha256(self) -> str:
        """Hash of the rule in canonical form: the same rule always gives the same hash."""
        canonical = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class BenchConfig:
    """How benchmark@DTYPE measures (the method is in pipeline/benchmark.py); the workload is the trial's."""

    warmup: int = 3
    """Untimed steps of each variant before any round (allocator, kernel choice, autocast cache)."""
    repeats: int = 10
    """Rounds: each times every variant (FP32, TF32 where the GPU has it, AMP) in rotating order, and each
    memory probe records one peak per round; medians, IQRs and per-round ratios come from these."""
    steps: int = 10
    """Back-to-back training steps per round, timed together (one clock reading per round)."""

    def check(self, key: str) -> None:
        _non_negative(self.warmup, f"{key}.warmup")
        _positive(self.repeats, f"{key}.repeats")
        _positive(self.steps, f"{key}.steps")


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str = "amp-validation"
    """MLflow experiment name."""

    def check(self, key: str) -> None:
        if not self.experiment.strip():
            raise UserError(f"params.yaml: {key}.experiment is empty; give the MLflow experiment a name")


@dataclass(frozen=True)
class DiagnoseConfig:
    """What diagnose@DTYPE may spend. Nothing here changes a trial: suggestions are written, never applied."""

    probe: Literal["always", "on_failure", "never"] = "on_failure"
    """When to map the precision of every op and measure gradient underflow on one training batch (a few
    passes): ``always`` (also for healthy trials: one process with torch and the model, ~the cost of a
    tiny trial), ``on_failure`` (a healthy trial then costs a JSON read), or ``never``."""
    search_budget: int = 4
    """Most trial re-runs (inference and training under a candidate ``trial.fp32_modules``) the FP32-region
    search may spend; 0 still locates the first non-finite value but checks no suggestion."""
    max_cases: int = 16
    """Most failing fixed-set cases replayed when locating a non-finite output."""

    def check(self, key: str) -> None:
        _non_negative(self.search_budget, f"{key}.search_budget")
        _positive(self.max_cases, f"{key}.max_cases")


@dataclass(frozen=True)
class Params:
    seed: int = 0
    """Seeds weights, batch order and every random draw."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` takes a GPU (CUDA or ROCm) when present, else the CPU."""
    task: TaskConfig = field(default_factory=TaskConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)

    def check(self, key: str = "") -> None:
        _non_negative(self.seed, "seed")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value.check(f.name)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate params.yaml.

    Raises:
        UserError: the file is missing or malformed, or a key is unknown, mistyped or impossible.
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} not found; run from the repository root or pass --params PATH") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path} is not valid YAML{where}; fix the syntax there") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path} must be a mapping of sections (seed, device, task, ...); it is a {type(raw).__name__}")
    params = build(Params, raw, "")
    params.check()
    return params


def build(cls: type, raw: Any, key: str) -> Any:
    """Turn a plain mapping into the dataclass ``cls``, naming the first key that does not fit."""
    if not isinstance(raw, dict):
        raise UserError(f"params.yaml: {key or 'top level'} must be a mapping, got {_show(raw)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for name in raw:
        if name not in names:
            raise UserError(
                f"params.yaml: unknown key {_join(key, str(name))!r}; remove it or use one of: {', '.join(names)}"
            )
    values = {name: _coerce(hints[name], raw[name], _join(key, name)) for name in names if name in raw}
    return cls(**values)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise UserError(f"params.yaml: {key} is {_show(value)}; use one of {choices}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"params.yaml: {key} must be a list, got {_show(value)}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"params.yaml: {key} must be a mapping, got {_show(value)}")
        return {str(k): _coerce(args[1], v, _join(key, str(k))) for k, v in value.items()}
    if hint is dict:
        if not isinstance(value, dict):
            raise UserError(f"params.yaml: {key} must be a mapping, got {_show(value)}")
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"params.yaml: {key} must be true or false, got {_show(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"params.yaml: {key} must be an integer, got {_show(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"params.yaml: {key} must be a number, got {_show(value)}")
        if not math.isfinite(value):
            raise UserError(f"params.yaml: {key} is {value}; use a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise UserError(f"params.yaml: {key} must be a string, got {_show(value)}")
        return value
    raise AssertionError(f"unsupported type {hint!r} for {key}")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "nothing (null)"


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise UserError(f"params.yaml: {key} is {value}; it must be greater than 0")


def _non_negative(value: float, key: str) -> None:
    if value < 0:
        raise UserError(f"params.yaml: {key} is {value}; it must be 0 or more")


def _fraction(value: float, key: str) -> None:
    if not 0 <= value <= 1:
        raise UserError(f"params.yaml: {key} is {value}; it must be a fraction between 0 and 1")
