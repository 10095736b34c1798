"""The decision artifact: ``data/decision/NAME/decision.json`` and its short metrics file, one owner.

decide writes it; benchmark, report and publish read it through ``read``. Torch-free and MLflow-free:
a decision is a function of the stage's DVC deps alone (the stats, the diagnosis, the manifests and the
rule), so the same commit gives the same bytes on any machine and against any tracking server.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from pipeline import paths
from pipeline.config import AcceptanceConfig, build
from pipeline.errors import UserError
from pipeline.files import StagedFolder, read_json, write_json

if TYPE_CHECKING:
    from pipeline.artifacts.comparison import Stats
    from pipeline.artifacts.trial import Failure

FILE = "decision.json"


@dataclass(frozen=True)
class Decision:
    """The rule's verdict on one trial, with what it was decided under.

    Three kinds of lines, each in its own field: ``reasons`` (the criteria that failed), ``findings`` (where
    the diagnosis says a rollback starts and what would fix it) and ``notes`` (facts said beside the
    verdict, such as a trial run elsewhere than the reference)."""

    variant: str
    decision: Literal["accept", "rollback"]
    reasons: list[str]
    """Every failed criterion (empty on accept)."""
    checks: list[str]
    """Every criterion that passed, so a reviewer sees what was verified."""
    rule: dict
    rule_sha256: str
    policy: dict
    """The trial's precision policy (dtype, fp32_modules)."""
    env: dict
    """Where the trial ran (backend, device, torch version)."""
    inference: Literal["accept", "rollback"] = "accept"
    """The trained reference run under the policy: values, decisions on every decided head, distribution, quality."""
    training: Literal["accept", "rollback"] = "accept"
    """Training under the policy: the trajectory, the updates, and the trained model's outputs and quality."""
    cases: dict = field(default_factory=dict)
    """On rollback: the ids of the cases (and ``steps``, the training steps) behind each failed criterion."""
    findings: list[str] = field(default_factory=list)
    """On rollback: the diagnosis' findings (``diagnosis.json``), in its order."""
    notes: list[str] = field(default_factory=list)
    """Warnings said beside the verdict (an environment that differs from the reference's)."""
    rollback_package: str | None = None
    """Folder of the rollback package, on rollback."""

    @property
    def accepted(self) -> bool:
        return self.decision == "accept"

    @property
    def dtype(self) -> str:
        """The autocast dtype of the trial's policy (``float16``, ``bfloat16``, ``float32``); the variant's name where the
        policy does not say."""
        return self.policy.get("dtype", self.variant)

    def acceptance(self) -> AcceptanceConfig:
        """The rule it was decided under (``rule``), typed."""
        return build(AcceptanceConfig, self.rule, "decision.rule")

    def as_dict(self) -> dict:
        out = asdict(self)
        # absent rather than empty: the file says only what happened
        for key in ("findings", "notes", "rollback_package", "cases"):
            if not out[key]:
                del out[key]
        return out


def of_failure(variant: str, failure: Failure, **recorded) -> Decision:
    """The rollback of a failed trial (it raised under its policy): the criterion "the variant runs under its policy"
    failed, said with the part, op, module and case or step (``Failure.line``), without the rule's statistics (there
    are no outputs to judge). Both parts roll back: the part that raised, and the other, which was not judged.
    ``recorded``: the fields every decision records (``rule``, ``rule_sha256``, ``policy``, ``env``, ``findings``,
    ``notes``, ``rollback_package``)."""
    other = "training" if failure.part == "inference" else "inference"
    where = {"steps": [failure.step]} if failure.step is not None else {"raised": [failure.case]} if failure.case else {}
    notes = [f"{other} was not judged: the trial stopped when its {failure.part} raised", *recorded.pop("notes", [])]
    return Decision(variant=variant, decision="rollback", reasons=[failure.line(variant)], checks=[], inference="rollback",
                    training="rollback", cases=where, notes=notes, **recorded)


def write(d: Decision, package: Callable[[Path], None] | None = None) -> None:
    """The decision and, for a rollback, its package (``package(folder)`` writes it into the new folder:
    ``rollback.write_package``), in place of the folder's previous content all together (``files.StagedFolder``)."""
    with StagedFolder(paths.decision(d.variant)) as out:
        if package is not None:
            package(out)
        write_json(out / FILE, d.as_dict())


def read(variant: str) -> Decision:
    """Raises: UserError when decide@NAME has not run, or wrote another format."""
    path = paths.decision(variant) / FILE
    raw = read_json(path, f"decide@{variant}")
    names = {f.name for f in fields(Decision)}
    if not isinstance(raw, dict) or not set(raw) <= names:
        raise UserError(f"{path} is not a decision of this version; rebuild it with `dvc repro --force decide@{variant}`")
    return Decision(**raw)


def summary_metrics(d: Decision, stats: Stats | None) -> dict:
    """What `dvc metrics show` and `dvc metrics diff` print per variant: what a user compares across experiments, under
    short names, so that the default example's table (with the benchmark's two numbers) fits 160 columns. The verdict
    in words (DVC prints a string metric as it is: ``accept``, ``rollback``), how many criteria failed (the report's
    count: the diagnosis' findings explain them and are not counted), flips of real cases and those near the boundary,
    the largest value gap, quality of the trial (inference, after training) and the largest training-loss gap. A failed
    trial (``stats`` None) has the first two alone. The verdict's two parts (inference, training) are in
    decision.json and the report."""
    verdict = {"decision": d.decision, "reasons": len(d.reasons)}
    if stats is None:
        return verdict
    return verdict | {
        "flips": stats.flips.real_flips,
        "near_flips": stats.flips.near_boundary_flips,
        "max_gap": stats.max_abs_gap,
        "quality_trial": stats.quality.trial,
        "quality_trained": stats.quality.trained,
        "loss_gap": stats.training.max_loss_gap,
    }


def write_metrics(d: Decision, stats: Stats | None) -> None:
    write_json(paths.decision_metrics(d.variant), summary_metrics(d, stats))
