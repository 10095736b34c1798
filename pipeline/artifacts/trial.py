"""The trial artifact of one variant (``data/trial/<variant>/``): written here, read back here, verified.

Files: the trained reference's outputs under the policy (``outputs.safetensors``), the outputs of the
model trained under the policy (``trained_outputs.safetensors``), its final training state
(``checkpoint.safetensors``), the per-step trajectory (``trajectory.json``) and the manifest, written
last, with every file's sha256. Outputs are streamed to disk chunk by chunk (``pipeline.artifacts.outputs``).

This module holds the manifest and the trajectory, typed and verified: decide, diagnose and report read
a trial through it alone (it imports neither torch nor any module that does). The tensors are written
and read by ``pipeline.artifacts.trial_tensors``, for trial, compare, the replays and the benchmark.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import paths
from pipeline.artifacts.record import Record
from pipeline.artifacts.steps import Steps
from pipeline.files import read_json

if TYPE_CHECKING:
    from pipeline.artifacts.reference import Manifest as ReferenceManifest


def produced_by(variant: str) -> str:
    return f"trial@{variant}"


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


def run_key(reference: ReferenceManifest, policy, recipe: str) -> str:
    """The trial's identity: its reference, its policy and the recipe params give now (``reference_tensors.recipe_key``):
    a resume state of another trial, or of this one under an edited recipe or loss, is not this one's."""
    blob = {"ref": reference.run_key, "policy": policy.as_dict(), "recipe": recipe}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


ENV_DEFAULTS = {"world_size": 1, "process_group_backend": None}
"""What an env that does not name these keys means (one process): a one-rank trial of a two-rank reference differs."""


def env_differs(env: dict, ref_env: dict) -> list[str]:
    """Keys of the environment (either side's) whose values differ between the trial and the reference."""
    return sorted(k for k in set(env) | set(ref_env) if env.get(k, ENV_DEFAULTS.get(k)) != ref_env.get(k, ENV_DEFAULTS.get(k)))
