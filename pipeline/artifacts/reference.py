"""The frozen FP32 reference's manifest, trajectories and FP16 forecast (``data/reference/``), typed and verified.

``Manifest`` says what the reference is, under which rule, and every file's sha256; ``check_rule`` is the
one refusal of a rule edited after freeze. decide, report and publish read the reference through this
module alone: it imports neither torch nor any module that does (nor, through them, the device code), so
these stages neither pay for torch nor depend on it. The tensors (checkpoints, cases, outputs) are read
and written by ``pipeline.artifacts.reference_tensors``, for the stages that train, infer or replay.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pipeline import paths
from pipeline.artifacts import forecast
from pipeline.artifacts.comparison import FP32Spread
from pipeline.artifacts.record import Record
from pipeline.artifacts.steps import Steps
from pipeline.config import AcceptanceConfig
from pipeline.heads import Roles
from pipeline.errors import UserError
from pipeline.files import read_json

PRODUCED_BY = "freeze"


@dataclass(frozen=True)
class Manifest:
    """``data/reference/manifest.json``: what the reference is, under which rule, and every file's sha256."""

    files: dict[str, str]
    """Repository-relative path -> sha256 of every file of the reference and of the prepared inputs it was frozen on."""
    rule_sha256: str
    run_key: str
    """The reference's identity (params, inputs, initial weights, task code): a trial names the reference it was made from."""
    env: dict
    policy: dict
    real_updates: int
    cases: dict
    """Case counts: ``total`` and one per kind."""
    fixed_set: dict
    roles: dict
    """The role table (``heads.Roles.as_dict``): how compare, diagnose, decide and the report judge each output."""

    def sha256(self, path: str | Path) -> str | None:
        """The recorded sha256 of ``path``, or None when the reference has no such file (no FP64 arbiter, no replicate)."""
        return self.files.get(str(path))

    def check_rule(self, acceptance: AcceptanceConfig) -> None:
        """Refuse to judge under a rule other than the one frozen with the reference.

        Raises:
            UserError: the rule in params.yaml was edited after freeze.
        """
        rule = acceptance.sha256()
        if self.rule_sha256 != rule:
            raise UserError(
                f"the acceptance rule in params.yaml (sha256 {rule[:12]}…) differs from the one frozen with the reference "
                f"({self.rule_sha256[:12]}…); the rule is fixed before the trial: run `dvc repro` to re-freeze under the new rule"
            )

    def as_dict(self) -> dict:
        return asdict(self)

    def output_roles(self) -> Roles:
        return Roles.read(self.roles)


def read_manifest() -> Manifest:
    """Raises: UserError when freeze has not run (or wrote another format: rerun it)."""
    raw = read_json(paths.REF_MANIFEST, PRODUCED_BY)
    names = [f.name for f in fields(Manifest)]
    if not isinstance(raw, dict) or set(raw) != set(names):
        raise UserError(
            f"{paths.REF_MANIFEST} is not a reference manifest of this version; rebuild it with `dvc repro --force {PRODUCED_BY}`"
        )
    return Manifest(**raw)


@dataclass(frozen=True)
class Trajectory(Record):
    """``data/reference/trajectory.json`` and the noise replicate's ``replicate_trajectory.json``: FP32 training's
    updates, and for the replicate how its data order was perturbed."""

    ABSENT = ("perturbation", "quality", "more")

    steps: Steps
    perturbation: str | None = None
    quality: FP32Spread | None = None
    """The replicates': their quality after training beside the reference's (FP32's own spread), where scored."""
    more: tuple[Steps, ...] | None = None
    """The replicates after the first (``reference.replicates`` > 1), each on its own data order; ``steps`` is the first's."""


def _trajectory(path: Path, manifest: Manifest) -> Trajectory:
    sha = manifest.sha256(path)
    if sha is None:
        raise UserError(f"{paths.REF_MANIFEST} names no {path}; rebuild the reference with `dvc repro --force {PRODUCED_BY}`")
    refused = f"{path} is not a trajectory of this version ({{}}); rebuild it with `dvc repro --force {PRODUCED_BY}`".format
    return Trajectory.parse(read_json(path, PRODUCED_BY, sha), refused)


def read_trajectory(manifest: Manifest | None = None) -> Steps:
    """The reference's per-step training records (verified against ``manifest``, read when not given)."""
    return _trajectory(paths.REF_TRAJECTORY, manifest or read_manifest()).steps


def read_replicates(manifest: Manifest | None = None) -> Trajectory | None:
    """The FP32 noise replicates' file (``reference.replicates``), verified: the first's steps, the others' (``more``)
    and their quality after training (``quality``); None without a replicate."""
    manifest = manifest or read_manifest()
    if manifest.sha256(paths.REF_REPLICATE_TRAJECTORY) is None:
        return None
    return _trajectory(paths.REF_REPLICATE_TRAJECTORY, manifest)


def read_replicate(manifest: Manifest | None = None) -> Steps | None:
    """The first FP32 noise replicate's per-step records, verified; None without one."""
    read = read_replicates(manifest)
    return None if read is None else read.steps


def read_forecast(manifest: Manifest | None = None) -> forecast.Headroom:
    """The FP16 headroom forecast freeze wrote beside the reference (verified against ``manifest``, read when not given).

    Raises: UserError when the reference has none (frozen by an earlier version: re-freeze).
    """
    manifest = manifest or read_manifest()
    sha = manifest.sha256(paths.REF_FORECAST)
    if sha is None:
        raise UserError(
            f"{paths.REF_MANIFEST} names no {paths.REF_FORECAST}; rebuild the reference with `dvc repro --force {PRODUCED_BY}`"
        )
    return forecast.read(paths.REFERENCE, PRODUCED_BY, sha)
