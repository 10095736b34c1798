"""The FP16 headroom forecast (``forecast.json`` in the folder its stage writes), and its check against the trial.

Loss-scale collapse is found hours into runs today (gpt-neox#291). Before any long run, the FP32 reference's own
activation and gradient magnitudes on a few training batches say whether float16 has the range: activations
beyond 65504 (float16's largest finite value) overflow in the forward, gradients whose magnitude times the
GradScaler's initial scale stays below 2**-24 (float16's smallest subnormal) vanish even scaled, and gradients
beyond 65504 at that scale make the scaler skip steps and halve its scale. ``pipeline.forecast`` computes it; this
module holds the records, the file and ``check``, which the report runs against what the trial then did. Torch-free.

The file holds a ``Headroom``: the forecast at the reference's initial weights (what a user has before any training,
and what the trial's first steps meet: their GradScaler halvings) and at its trained weights (what the trial meets late
in training, and what its inference runs on), with the recommendation of the worse of the two.

API:
    headroom(initial: Forecast, trained: Forecast) -> Headroom
    write(folder, headroom: Headroom) -> None
    read(folder, produced_by="", sha256=None) -> Headroom   raises UserError when the file is missing, differs from
                                                            ``sha256`` or is of another form
    check(headroom, steps, outputs_finite, fp32_modules) -> ForecastCheck
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline import paths
from pipeline.artifacts.record import Record
from pipeline.artifacts.steps import Steps
from pipeline.files import read_json, rerun, write_json

FILE = paths.REF_FORECAST.name

FP16_MAX = 65504.0
FP16_SMALLEST_SUBNORMAL = 2.0**-24
UNDERFLOW_LIMIT = 0.01
"""More than this fraction of the live parameter-gradient elements vanishing at the scale the trial settles on means
"use bf16". A healthy model loses none at 65536 (its gradients sit 20 binades and more above 2**-24 * 65536); a
percent lost is a gradient distribution whose low tail lies below float16's 40 binades, which the GradScaler only
reaches by growing its scale, one doubling per 2000 clean steps."""
TOO_MANY_FP32 = 0.5
"""When more than this fraction of the layers that hold parameters would need fp32_modules, the FP16 trial runs
mostly in FP32: bfloat16 (FP32's exponent range) gives the speed without the list."""
HALVING_SLACK = 1
"""The trial's leading skipped steps may differ from the forecast halvings by this much: the forecast reads FP32
gradients of a few batches, the trial float16 ones of its own batches, which move the maximum by about a binade."""


@dataclass(frozen=True)
class ModuleHeadroom(Record):
    """One module's largest activations in the FP32 reference, against float16's range."""

    type: str
    max_abs_input: float
    max_abs_output: float
    beyond_fp16: bool
    """Its input or its output exceeds 65504: in float16 the value is inf (its cast, or its own result)."""


@dataclass(frozen=True)
class GradientHeadroom(Record):
    """Gradient elements of the FP32 reference (all batches together) at the GradScaler's scales."""

    elements: int
    nonzero: int
    max_abs: float
    underflow_initial: int
    """Nonzero elements whose magnitude times the initial scale is below 2**-24: zero in float16 even scaled."""
    overflow_initial: int
    """Elements whose magnitude times the initial scale exceeds 65504: inf in float16, a skipped step."""
    underflow_settled: int
    """As ``underflow_initial``, at the scale after the forecast halvings."""


@dataclass(frozen=True)
class Forecast(Record):
    """Whether float16 has the range for this model, from its FP32 reference, and what to do if not."""

    initial_scale: float
    batches: int
    largest_activation: float
    largest_activation_module: str
    modules: dict[str, ModuleHeadroom]
    beyond_fp16: tuple[str, ...]
    """The innermost modules whose input or output exceeds 65504 (none of their submodules does); "" is the model's
    own code."""
    parameter_gradients: GradientHeadroom
    activation_gradients: GradientHeadroom
    """Gradients of the outputs of the modules without submodules (each tensor once)."""
    parameters: dict[str, GradientHeadroom]
    underflow_fraction: float
    """Of the nonzero parameter-gradient elements, at the initial scale."""
    overflow_fraction: float
    """Of the parameter- and activation-gradient elements, at the initial scale."""
    halvings: int
    """How often the GradScaler halves its scale before the largest gradient (parameter or activation) fits 65504."""
    settled_scale: float
    underflow_fraction_settled: float
    recommendation: str
    """``fp16 is safe``, ``fp16 needs fp32_modules`` or ``use bf16``."""
    fp32_modules: tuple[str, ...]
    """The list to trial, with ``fp16 needs fp32_modules``; empty otherwise."""
    line: str


SEVERITY = ("fp16 is safe", "fp16 needs fp32_modules", "use bf16")
"""The recommendations, mildest first: the worse of two forecasts is the later one here."""


@dataclass(frozen=True)
class Headroom(Record):
    """``forecast.json``: the forecast at the reference's initial and trained weights, and what to do about both."""

    initial: Forecast
    trained: Forecast
    worse: str
    """``initial`` or ``trained``: the forecast whose recommendation (then halvings, underflow, largest activation) is
    the worse; ``initial`` on a tie."""
    recommendation: str
    fp32_modules: tuple[str, ...]
    """With ``fp16 needs fp32_modules``: the modules either forecast names (the trial needs both kept in FP32)."""
    line: str

    @property
    def beyond_fp16(self) -> tuple[str, ...]:
        """The modules beyond 65504 at either end of the reference's training, in order, each once."""
        return tuple(dict.fromkeys(self.initial.beyond_fp16 + self.trained.beyond_fp16))


def _severity(f: Forecast) -> tuple:
    return (SEVERITY.index(f.recommendation), f.halvings, f.underflow_fraction_settled, f.largest_activation)


def headroom(initial: Forecast, trained: Forecast) -> Headroom:
    """Both forecasts, and the recommendation of the worse: a model fp16 holds at the start may leave its range as its
    weights grow, and one that settles may overflow in its first steps."""
    later = _severity(trained) > _severity(initial)
    worse, name, other, opposite = (trained, "trained", initial, "initial") if later else (initial, "initial", trained, "trained")
    modules = tuple(dict.fromkeys(initial.fp32_modules + trained.fp32_modules)) if worse.fp32_modules else ()
    line = f"{worse.line} (at the reference's {name} weights; at its {opposite} weights: {other.recommendation})"
    if modules != worse.fp32_modules:
        line = (
            f"fp16 needs fp32_modules {list(modules)}: activations beyond 65504 at the reference's initial weights "
            f"({list(initial.fp32_modules)}) and at its trained weights ({list(trained.fp32_modules)})"
        )
    return Headroom(initial=initial, trained=trained, worse=name, recommendation=worse.recommendation, fp32_modules=modules,
                    line=line)


@dataclass(frozen=True)
class ForecastCheck(Record):
    """The forecast against the float16 trial that followed it (``Diagnosis.forecast``)."""

    recommendation: str
    forecast: str
    """The forecast's own sentence (``Headroom.line``), said beside the check in the verdict."""
    held: bool
    expected: str
    observed: str
    line: str
    """``forecast held: ...`` or ``forecast missed: ...``: the report's sentence."""


def write(folder: str | Path, headroom: Headroom) -> None:
    write_json(Path(folder) / FILE, headroom.as_dict())


def read(folder: str | Path, produced_by: str = "", sha256: str | None = None) -> Headroom:
    """Raises: UserError when the folder holds no forecast, one that differs from ``sha256`` (its manifest's), or one of
    another version."""
    path = Path(folder) / FILE
    return Headroom.parse(
        read_json(path, produced_by, sha256),
        lambda _: f"{path} is not a forecast of this version; rebuild it with {rerun(produced_by)}",
    )


def _covered(module: str, fp32_modules: Sequence[str]) -> bool:
    return any(m == "" or module == m or module.startswith(m + ".") for m in fp32_modules)


def check(headroom: Headroom, steps: Steps, outputs_finite: bool, fp32_modules: Sequence[str]) -> ForecastCheck:
    """The forecast against a float16 trial: its trajectory's ``steps``, whether its outputs stayed finite, and the
    ``fp32_modules`` it ran with.

    Activations beyond 65504 (at either end of the reference's training) in a module the trial did not keep in FP32
    should overflow: non-finite outputs, or the scale collapsing (no real update, or most steps after the first one
    skipped). Otherwise the outputs should stay finite, the trial skip about the initial weights' ``halvings`` steps at
    its start (it starts from them; ``HALVING_SLACK``), and its scale not collapse. Underflow is not visible in a
    trajectory (the scaler does not see a zero); compare's gradient check judges it.
    """
    exposed = [m for m in headroom.beyond_fp16 if not _covered(m, fp32_modules)]
    if not steps:  # inference only (reference.train_steps 0): the outputs alone say whether activations overflowed
        expected = (f"activations beyond 65504 in {exposed} to overflow (non-finite outputs)" if exposed
                    else "finite outputs")
        observed = f"ran no training (inference only), outputs {'finite' if outputs_finite else 'non-finite'}"
        held = outputs_finite != bool(exposed)
        line = f"forecast held: expected {expected}; the trial {observed}" if held else (
            f"forecast missed: expected {expected}, but the trial {observed}")
        return ForecastCheck(recommendation=headroom.recommendation, forecast=headroom.line, held=held, expected=expected,
                             observed=observed, line=line)
    halvings = headroom.initial.halvings
    n = len(steps)
    skipped = sum(s.skipped for s in steps)
    leading = next((i for i, s in enumerate(steps) if not s.skipped), n)
    settled = f", then ran at scale {steps[leading].scale:g}" if leading < n else ""
    observed = (
        f"skipped {leading} leading and {skipped} of {n} steps{settled}, outputs {'finite' if outputs_finite else 'non-finite'}"
    )
    collapsed = leading == n or 2 * (skipped - leading) > n - leading
    if exposed:
        expected = f"activations beyond 65504 in {exposed} to overflow (non-finite outputs, or the scale collapsing)"
        held = not outputs_finite or collapsed
    else:
        expected = f"finite outputs and {halvings} leading skipped step(s) (±{HALVING_SLACK}), then mostly real updates"
        held = outputs_finite and abs(leading - halvings) <= HALVING_SLACK and not collapsed
    line = f"forecast held: expected {expected}; the trial {observed}" if held else (
        f"forecast missed: expected {expected}, but the trial {observed}"
    )
    return ForecastCheck(recommendation=headroom.recommendation, forecast=headroom.line, held=held, expected=expected,
                         observed=observed, line=line)
