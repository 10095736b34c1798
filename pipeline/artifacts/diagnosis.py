"""The diagnosis artifact: ``data/diagnose/DTYPE/diagnosis.json`` (and ``suggested_params.yaml``), one owner.

diagnose writes it; decide, publish and the verdict read it through ``read``. Torch-free: a healthy
trial's diagnosis is written without torch, and read without it everywhere.

The file says only what was done: triage's fields always; the probe's (``precision_map``, ``underflow``)
when it ran; the search's (``local_fix``, ``reruns``, ``ranking``, ``suggestion``, null when nothing was
chosen) whenever the full diagnosis ran; the located failure and the un-flips when the trial failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from pipeline import paths
from pipeline.errors import UserError
from pipeline.files import read_json, write_bytes, write_json

FILE = "diagnosis.json"
SUGGESTED = "suggested_params.yaml"


def _no_work() -> dict:
    return {"replayed_steps": 0, "traced_passes": 0, "trial_reruns": 0}


@dataclass(frozen=True)
class Diagnosis:
    """Why a trial failed and what would fix it, as lines (``findings``, ``notes``) and structured details."""

    needed: bool = False
    """The rule failed the trial (or ``diagnose.probe: always`` asked for the probe anyway)."""
    failing: list[str] = field(default_factory=list)
    """The rule's failed criteria, as the diagnosis was given them."""
    findings: list[str] = field(default_factory=list)
    """Where the failure starts, what fixes it, the suggestion, what the probe saw: what decide attaches to a rollback."""
    notes: list[str] = field(default_factory=list)
    """Facts recorded beside the findings, not said in the verdict."""
    work: dict = field(default_factory=_no_work)
    """What the diagnosis cost, in units of the trial's own work: ``replayed_steps``, ``traced_passes``, ``trial_reruns``."""
    precision_map: dict | None = None
    underflow: dict | None = None
    reference_fails_rule: list[str] | None = None
    first_nonfinite: list[dict] | None = None
    unflipped_by: list[dict] | None = None
    local_fix: list | None = None
    reruns: list | None = None
    ranking: list[dict] | None = None
    suggestion: dict | None = None
    """``fp32_modules``, ``rule_passes``, ``file`` (the suggested params), or None when nothing was chosen."""

    def as_dict(self) -> dict:
        searched = self.ranking is not None  # the search's fields come together, its null suggestion included
        return {k: v for k, v in asdict(self).items() if v is not None or (k == "suggestion" and searched)}


def write(dtype: str, diagnosis: Diagnosis, suggested_params: str | None = None) -> None:
    """The diagnosis, and the suggestion as a params fragment when there is one (never applied)."""
    out = paths.diagnose(dtype)
    if suggested_params is not None:
        write_bytes(out / SUGGESTED, suggested_params.encode())
    write_json(out / FILE, diagnosis.as_dict())


def from_dict(raw: dict, where: str = FILE, dtype: str = "DTYPE") -> Diagnosis:
    """Raises: UserError when ``raw`` holds keys a diagnosis of this version does not have."""
    names = {f.name for f in fields(Diagnosis)}
    if not isinstance(raw, dict) or not set(raw) <= names:
        raise UserError(f"{where} is not a diagnosis of this version; rebuild it with `dvc repro --force diagnose@{dtype}`")
    return Diagnosis(**raw)


def read(dtype: str) -> Diagnosis:
    """Raises: UserError when diagnose@DTYPE has not run."""
    path = paths.diagnose(dtype) / FILE
    return from_dict(read_json(path, f"diagnose@{dtype}"), str(path), dtype)
