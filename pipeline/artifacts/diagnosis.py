"""The diagnosis artifact: ``data/diagnose/NAME/diagnosis.json`` (and ``suggested_params.yaml``), one owner.

diagnose writes it; decide, publish and the verdict read it through ``read``. Torch-free: a healthy
trial's diagnosis is written without torch, and read without it everywhere.

The file says only what was done: triage's fields always; the forecast check (``forecast``) for a float16
variant; the probe's (``precision_map``, ``underflow``) when it ran; the search's (``local_fix``, ``reruns``,
``ranking``, ``suggestion``, null when nothing was chosen) whenever the full diagnosis ran; the located failure
and the un-flips when the trial failed.

Every part is a frozen record read by attribute (the diagnosis computes them: ``Trace`` and ``PrecisionMap``
in ``pipeline.diagnosis``, the search's ``LocalFix``, ``Rerun``, ``Ranked``, ...); ``as_dict`` gives the
file's keys back, ``from_dict`` refuses a key it does not know.

API:
    write(variant, diagnosis: Diagnosis, suggested_params: str | None) -> None
    read(variant) -> Diagnosis             raises UserError when diagnose@NAME has not run (or wrote another form)
    from_dict(raw) -> Diagnosis / Diagnosis.as_dict()
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.artifacts.forecast import ForecastCheck
from pipeline.artifacts.record import Record, dump
from pipeline.files import StagedFolder, read_json, write_bytes, write_json

if TYPE_CHECKING:
    from pipeline.artifacts.trial import Failure

FILE = "diagnosis.json"
SUGGESTED = "suggested_params.yaml"


# --- what a watched pass saw (pipeline.diagnosis.trace, precision_map) -----------------------------------------


@dataclass(frozen=True)
class FirstNonFinite(Record):
    """The first non-finite value of a pass: the op that made it from finite inputs, with its module; for a
    non-finite input (``where == "input"``) nothing but ``where``."""

    ABSENT = ("phase", "module", "module_type", "op", "input_dtypes", "output_dtypes", "max_abs_input",
              "max_abs_finite_output", "nonfinite_elements", "cast")

    where: str
    """``input``, ``module`` (a module's forward), ``loss`` or ``gradient`` (a backward op)."""
    phase: str | None = None
    module: str | None = None
    """Qualified name of the module the op ran for; "" for the model's own code outside any submodule."""
    module_type: str | None = None
    op: str | None = None
    input_dtypes: str | None = None
    output_dtypes: str | None = None
    max_abs_input: float | None = None
    max_abs_finite_output: float | None = None
    nonfinite_elements: int | None = None
    cast: bool | None = None
    """The op is autocast's cast of an input (``_to_copy``)."""


@dataclass(frozen=True)
class MissingKernel(Record):
    """An op without a kernel for the reduced dtype on this device (the diagnosis ran it in float32)."""

    op: str
    module: str
    module_type: str
    phase: str
    dtypes: tuple[str, ...]
    error: str


@dataclass(frozen=True)
class ModuleStat(Record):
    """One module's outputs in a traced pass."""

    type: str
    dtype: str
    max_abs: float
    """Largest finite magnitude of its outputs."""
    finite: bool


@dataclass(frozen=True)
class Trace(Record):
    """One watched forward and backward pass under ``policy`` at loss ``scale``."""

    policy: dict
    scale: float
    input_finite: bool
    outputs_finite: bool
    loss: float | None
    """None for an inference pass."""
    gradients_finite: bool | None
    nonfinite_gradients: tuple[str, ...]
    """Parameters whose gradients are not finite after unscaling."""
    first: FirstNonFinite | None
    modules: dict[str, ModuleStat]
    missing_kernels: tuple[MissingKernel, ...]


@dataclass(frozen=True)
class LocatedCase(Record):
    """A failing case traced under the trial's policy (``amp``), in FP32, and (a gradient failure at a loss
    scale above 1) without scaling."""

    case: str
    ids: tuple[str, ...]
    step: int | None
    scale: float
    replay_matches_trial: bool | None
    amp: Trace
    fp32: Trace
    unscaled: Trace | None


@dataclass(frozen=True)
class OpRow(Record):
    """One row of the precision map: an op with its input and output dtypes, summed over modules."""

    phase: str
    op: str
    input_dtypes: str
    output_dtypes: str
    count: int
    flops: int
    reduced: bool
    matmul_like: bool


@dataclass(frozen=True)
class MatmulWork(Record):
    """Matmul-like work one module ran itself, and how much of it in reduced precision."""

    count: int
    reduced_count: int
    flops: int
    reduced_flops: int


@dataclass(frozen=True)
class MatmulSummary(Record):
    matmul_ops: int
    matmul_ops_reduced: int
    matmul_flops: int
    matmul_flops_reduced: int
    reduced_share: float
    """FLOP-weighted where FLOPs are known, else by count (``share_weighted_by``)."""
    share_weighted_by: str


@dataclass(frozen=True)
class PrecisionMap(Record):
    """What really ran in which precision in one forward and backward pass."""

    dtype: str
    fp32_modules: tuple[str, ...]
    batch: int
    summary: MatmulSummary
    ops: tuple[OpRow, ...]
    matmul_by_module: dict[str, MatmulWork]
    missing_kernels: tuple[MissingKernel, ...]
    error: str | None
    """The error a pass stopped on, when the float32 fallback could not get past it."""


@dataclass(frozen=True)
class UnderflowCounts(Record):
    """Gradient elements of a parameter (or all of them, ``Underflow.total``) against FP32's."""

    elements: int
    nonzero_fp32: int
    vanished_unscaled: int
    vanished_scaled: int
    nonfinite_unscaled: int
    nonfinite_scaled: int
    fraction_unscaled: float
    fraction_scaled: float


@dataclass(frozen=True)
class ParameterUnderflow(UnderflowCounts):
    parameter: str = ""
    """The parameter's qualified name (last only because the counts come first in the base record)."""


@dataclass(frozen=True)
class Underflow(Record):
    """Gradient elements that are zero under autocast but not in FP32, without loss scaling and at ``scale``."""

    dtype: str | None
    scale: float
    parameters: tuple[ParameterUnderflow, ...]
    total: UnderflowCounts


# --- what the search did (pipeline.diagnosis.search) ------------------------------------------------------------


@dataclass(frozen=True)
class FixStep(Record):
    """One round of the local fix: the FP32 regions after it, and each case's replay."""

    fp32_modules: tuple[str, ...]
    cases_finite: tuple[bool, ...]
    first: tuple[FirstNonFinite | None, ...]


@dataclass(frozen=True)
class LocalFix(Record):
    """The local fix of the non-finite cases: FP32 regions from ``start`` (key ``from``) to ``end`` (``to``)."""

    KEYS = {"start": "from", "end": "to"}

    start: tuple[str, ...]
    end: tuple[str, ...]
    cases_finite: bool
    steps: tuple[FixStep, ...]


@dataclass(frozen=True)
class Rerun(Record):
    """A re-run of the trial under other FP32 regions, and the rule's verdict on it."""

    fp32_modules: tuple[str, ...]
    decision: str
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Ranked(Record):
    """A module by what its own reduced-precision work does to the outputs (every other candidate in FP32)."""

    module: str
    type: str
    failing_elements: int
    max_abs_error: float


@dataclass(frozen=True)
class Unflip(Record):
    """A flipped real case and the module whose FP32 replay alone gives its reference class back (or None)."""

    id: str
    module: str | None


@dataclass(frozen=True)
class Suggestion(Record):
    """FP32 regions to trial (written as ``suggested_params.yaml``, never applied)."""

    fp32_modules: tuple[str, ...]
    rule_passes: bool | None
    """True when a re-run under it passed the rule; None when the budget left it unchecked."""
    file: str


@dataclass(frozen=True)
class Work(Record):
    """What the diagnosis cost, in units of the trial's own work (deterministic, unlike seconds)."""

    replayed_steps: int = 0
    traced_passes: int = 0
    trial_reruns: int = 0

    def plus(self, replayed_steps: int = 0, traced_passes: int = 0, trial_reruns: int = 0) -> Work:
        return replace(
            self,
            replayed_steps=self.replayed_steps + replayed_steps,
            traced_passes=self.traced_passes + traced_passes,
            trial_reruns=self.trial_reruns + trial_reruns,
        )


@dataclass(frozen=True)
class Diagnosis(Record):
    """Why a trial failed and what would fix it, as lines (``findings``, ``notes``) and structured details."""

    ABSENT = ("precision_map", "underflow", "reference_fails_rule", "first_nonfinite", "unflipped_by", "local_fix", "reruns",
              "ranking", "suggestion", "forecast")

    needed: bool = False
    """The rule failed the trial (or ``diagnose.probe: always`` asked for the probe anyway)."""
    failing: list[str] = field(default_factory=list)
    """The rule's failed criteria, as the diagnosis was given them."""
    findings: list[str] = field(default_factory=list)
    """Where the failure starts, what fixes it, the suggestion, what the probe saw: what decide attaches to a rollback."""
    notes: list[str] = field(default_factory=list)
    """Facts recorded beside the findings, not said in the verdict."""
    work: Work = field(default_factory=Work)
    precision_map: PrecisionMap | None = None
    underflow: Underflow | None = None
    reference_fails_rule: list[str] | None = None
    first_nonfinite: tuple[LocatedCase, ...] | None = None
    unflipped_by: tuple[Unflip, ...] | None = None
    local_fix: tuple[LocalFix, ...] | None = None
    reruns: tuple[Rerun, ...] | None = None
    ranking: tuple[Ranked, ...] | None = None
    suggestion: Suggestion | None = None
    """None when nothing was chosen (written as null whenever the search ran)."""
    forecast: ForecastCheck | None = None
    """The FP16 headroom forecast (``data/reference/forecast.json``) against this trial: float16 variants only."""

    def as_dict(self) -> dict:
        searched = self.ranking is not None  # the search's fields come together, its null suggestion included
        return super().as_dict() | ({"suggestion": dump(self.suggestion)} if searched else {})


def of_failure(failure: Failure) -> Diagnosis:
    """The diagnosis of a failed trial: where it raised (``failure``, located by the trial's watched replay) is its one
    finding, and the module it raised in its suggested FP32 region (unchecked: written as no file, said as a command
    by the verdict); nothing is replayed or probed, since the trial has no outputs."""
    where = f"module '{failure.module}' ({failure.module_type})" if failure.module else f"the model ({failure.module_type})"
    op = f"op {failure.op}" if failure.op else "the model's own code"
    when = f"case {failure.case}" if failure.case is not None else f"step {failure.step}" if failure.step is not None else ""
    return Diagnosis(
        needed=True,
        failing=["the variant runs under its policy"],
        findings=[f"the {failure.part} raised first in {op} of {where}" + (f" on {when}" if when else "")
                  + " (one watched replay); with no outputs, nothing else was replayed or probed"],
        suggestion=Suggestion(fp32_modules=(failure.module,), rule_passes=None, file="") if failure.module else None,
    )


def write(variant: str, diagnosis: Diagnosis, suggested_params: str | None = None) -> None:
    """The diagnosis, and the suggestion as a params fragment when there is one (never applied), in place of the
    folder's previous content all together (``files.StagedFolder``)."""
    with StagedFolder(paths.diagnose(variant)) as out:
        if suggested_params is not None:
            write_bytes(out / SUGGESTED, suggested_params.encode())
        write_json(out / FILE, diagnosis.as_dict())


def from_dict(raw: dict, where: str = FILE, variant: str = "NAME") -> Diagnosis:
    """Raises: UserError when ``raw`` is not a diagnosis of this version (a key it does not know, or one missing)."""
    return Diagnosis.parse(
        raw, lambda _: f"{where} is not a diagnosis of this version; rebuild it with `dvc repro --force diagnose@{variant}`"
    )


def read(variant: str) -> Diagnosis:
    """Raises: UserError when diagnose@NAME has not run."""
    path = paths.diagnose(variant) / FILE
    return from_dict(read_json(path, f"diagnose@{variant}"), str(path), variant)
