"""The trial artifact of one variant (``data/trial/<variant>/``): written here, read back here, verified.

Files: the trained reference's outputs under the policy (``outputs.safetensors``), the outputs of the
model trained under the policy (``trained_outputs.safetensors``), its final training state
(``checkpoint.safetensors``), the per-step trajectory (``trajectory.json``) and the manifest, written
last, with every file's sha256. Outputs are streamed to disk chunk by chunk (``pipeline.artifacts.outputs``).

A trial that raised under its policy (an op that overflows or has no kernel for the dtype) is a *failed trial*:
the folder holds ``failure.json`` (``Failure``: which part raised, the op, the module, the case or step) and the
manifest alone. Every later stage reads it (``read_failure``) and the variant is rolled back, naming the op.

This module holds the manifest and the trajectory, typed and verified: decide, diagnose and report read
a trial through it alone (it imports neither torch nor any module that does). The tensors are written
and read by ``pipeline.artifacts.trial_tensors``, for trial, compare, the replays and the benchmark.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline import paths
from pipeline.artifacts.record import Record
from pipeline.artifacts.steps import Steps
from pipeline.files import read_json

if TYPE_CHECKING:
    from pipeline.artifacts.reference import Manifest as ReferenceManifest


FAILURE = "failure.json"
"""The one file of a failed trial beside its manifest (``Failure``)."""


def produced_by(variant: str) -> str:
    return f"trial@{variant}"


@dataclass(frozen=True)
class Failure(Record):
    """``data/trial/NAME/failure.json``: the trial raised under its policy, and where (``pipeline.diagnosis.failure``)."""

    ABSENT = ("case", "step")

    part: Literal["inference", "training"]
    """``inference``: the trained reference under the policy; ``training``: the training loop, or the trained model's
    outputs under the policy (then ``case`` is set, ``step`` not)."""
    error: str
    """The exception's type and the first line of its message."""
    missing_kernel: bool
    """The op has no kernel for the dtype on this device (``devices.missing_kernel``), rather than raising in one."""
    op: str
    """The torch function that raised (``torch.Tensor.masked_fill``), or "" when the model's own code raised."""
    module: str
    """The qualified name of the innermost module running (``encoder.layer.0.attention``); "" is the model itself."""
    module_type: str
    dtype: str
    device: str
    case: str | None = None
    """The first case of the fixed set whose forward raised."""
    step: int | None = None
    """The training step (0-based, as in the trajectory) that raised."""

    def line(self, variant: str) -> str:
        """The failure in one sentence, with its fix: the rollback's reason."""
        what = (f"has no {self.dtype} kernel on {self.device}" if self.missing_kernel
                else f"raised under {self.dtype} autocast on {self.device}")
        where = f"module '{self.module}' ({self.module_type})" if self.module else f"the model itself ({self.module_type})"
        at = f"op {self.op} of {where}" if self.op else f"the code of {where}"
        when = f" on case {self.case}" if self.case is not None else f" at step {self.step}" if self.step is not None else ""
        fix = (f"keep that module in FP32 (trial.policies.{variant}.fp32_modules: [{self.module}]) or trial another dtype"
               if self.module else "move that op into a submodule kept in FP32 (trial.policies."
               f"{variant}.fp32_modules), or trial another dtype")
        return f"{self.part}: the model {what} in {at}{when}: {self.error}; {fix}"


@dataclass(frozen=True)
class TrialManifest(Record):
    """``data/trial/NAME/manifest.json``: the policy that ran, where, from which reference, every file's sha256."""

    ABSENT = ("transforms",)

    files: dict[str, str]
    """File name in the trial folder -> sha256."""
    policy: dict
    reference_run_key: str
    rule_sha256: str
    env: dict
    env_differs_from_reference: list[str]
    """Keys of the environment whose values differ from the reference's (``world_size``, ``threads``...)."""
    real_updates: int
    transforms: dict | None = None
    """What the policy did to the model's code (``transforms.Applied.as_dict``): the float8 layers, whether their
    kernels were real or emulated, whether it was compiled. None (absent from the file) for a plain autocast trial,
    which ``transforms.Applied.as_dict`` gives as ``{}``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "transforms", self.transforms or None)  # absent rather than empty: the bytes of before

    @property
    def failed(self) -> bool:
        """The trial raised under its policy: the folder holds ``failure.json`` and no outputs (``read_failure``)."""
        return FAILURE in self.files

    def env_notes(self, reference_env: dict) -> list[str]:
        """Floating-point results differ across devices and execution paths: a trial run elsewhere than its
        reference says so, beside the verdict (empty when the environments agree)."""
        if not self.env_differs_from_reference:
            return []
        return [
            f"the trial ran with a different {', '.join(self.env_differs_from_reference)} than the reference: "
            f"{reference_env} vs {self.env}"
        ]


@dataclass(frozen=True)
class Trajectory(Record):
    """``data/trial/NAME/trajectory.json``: what training under the policy did, step by step."""

    ABSENT = ("aligned_fp32",)  # absent rather than null: the file says only what happened

    steps: Steps
    final_scale: float
    scaler_enabled: bool
    aligned_fp32: Steps | None = None
    """FP32 with this trial's GradScaler skips skipped too (``training.aligned_fp32``), or None without skips."""


def _typed(cls: type[Record], raw, path: Path, variant: str):
    """``cls`` from a JSON object holding exactly its fields (the optional ones may be absent)."""
    return cls.parse(
        raw, lambda why: f"{path} is not a trial file of this version ({why}); rebuild it with "
        f"`dvc repro --force {produced_by(variant)}`"
    )


def read_manifest(variant: str) -> TrialManifest:
    """Raises: UserError when trial@NAME has not run."""
    path = paths.trial(variant) / paths.TRIAL_MANIFEST
    return _typed(TrialManifest, read_json(path, produced_by(variant)), path, variant)


def read_trajectory(variant: str, manifest: TrialManifest | None = None) -> Trajectory:
    """The trial's trajectory, verified against its manifest (read when not given)."""
    manifest = manifest or read_manifest(variant)
    path = paths.trial(variant) / paths.TRIAL_TRAJECTORY
    return _typed(Trajectory, read_json(path, produced_by(variant), manifest.files[paths.TRIAL_TRAJECTORY]), path, variant)


def read_failure(variant: str, manifest: TrialManifest | None = None) -> Failure | None:
    """Where the trial raised, verified against its manifest; None for a trial that ran (read when not given)."""
    manifest = manifest or read_manifest(variant)
    if not manifest.failed:
        return None
    path = paths.trial(variant) / FAILURE
    return _typed(Failure, read_json(path, produced_by(variant), manifest.files[FAILURE]), path, variant)


def run_key(reference: ReferenceManifest, policy, recipe: str) -> str:
    """The trial's identity: its reference, its policy and the recipe params give now (``reference_tensors.recipe_key``):
    a resume state of another trial, or of this one under an edited recipe or loss, is not this one's."""
    blob = {"ref": reference.run_key, "policy": policy.as_dict(), "recipe": recipe}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


ENV_DEFAULTS = {"world_size": 1, "process_group_backend": None, "distributed_strategy": None, "fsdp_blocks": None}
"""What an env that does not name these keys means (one process): a one-rank trial of a two-rank reference differs."""


def env_differs(env: dict, ref_env: dict) -> list[str]:
    """Keys of the environment (either side's) whose values differ between the trial and the reference."""
    return sorted(k for k in set(env) | set(ref_env) if env.get(k, ENV_DEFAULTS.get(k)) != ref_env.get(k, ENV_DEFAULTS.get(k)))
