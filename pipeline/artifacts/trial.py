"""The trial artifact of one dtype (``data/trial/<dtype>/``): written here, read back here, verified.

Files: the trained reference's outputs under the policy (``outputs.safetensors``), the outputs of the
model trained under the policy (``trained_outputs.safetensors``), its final training state
(``checkpoint.safetensors``), the per-step trajectory (``trajectory.json``) and the manifest, written
last, with every file's sha256. Outputs are streamed to disk chunk by chunk (``pipeline.artifacts.outputs``).
compare, diagnose and report read a trial through ``load`` only.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch

from pipeline import checkpoint, paths

from pipeline.artifacts import outputs as output_store
from pipeline.files import read_json, sha256_file, write_json
from pipeline.errors import UserError


class Writer:
    """Streams a trial's outputs as they are computed, then writes its state, trajectory and manifest.

    Outputs stream to pending files beside their final names and replace them only in ``finish``: a trial
    that fails half-way (a missing kernel, a kill) leaves the previous outputs as they were. Used as a
    context manager, pending files are removed when the block raises.
    """

    def __init__(self, dtype: str, ids: list[str]) -> None:
        self.folder = paths.trial(dtype)
        self.ids = ids
        self.files: dict[str, str] = {}
        self.pending: dict[str, Path] = {}

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, typ, exc, tb) -> None:
        if exc is not None:
            for path in self.pending.values():
                path.unlink(missing_ok=True)

    def sink(self, name: str, chunks: Iterable[dict[str, torch.Tensor]]) -> None:
        """``name`` is ``outputs`` or ``trained_outputs`` (what ``training.run_trial`` streams)."""
        file = f"{name}.safetensors"
        self.pending[file] = self.folder / f".{file}.pending"
        self.files[file] = output_store.write_outputs(self.pending[file], chunks, self.ids)

    def finish(self, result, policy, reference_manifest: dict, env: dict, aligned: list | None = None) -> dict:
        """Move the outputs into place, write the training state, the trajectory and (last) the manifest."""
        for file, path in sorted(self.pending.items()):
            os.replace(path, self.folder / file)
        self.pending.clear()
        self.files[paths.TRIAL_CHECKPOINT] = checkpoint.save(self.folder / paths.TRIAL_CHECKPOINT, result.state)
        write_json(
            self.folder / paths.TRIAL_TRAJECTORY,
            {"steps": [asdict(r) for r in result.records], "final_scale": result.final_scale, "scaler_enabled": policy.uses_scaler,
             **({"aligned_fp32": [asdict(r) for r in aligned]} if aligned is not None else {})},
        )
        self.files[paths.TRIAL_TRAJECTORY] = sha256_file(self.folder / paths.TRIAL_TRAJECTORY)
        manifest = {
            "files": dict(sorted(self.files.items())),
            "policy": policy.as_dict(),
            "reference_run_key": reference_manifest["run_key"],
            "rule_sha256": reference_manifest["rule_sha256"],
            "env": env,
            "env_differs_from_reference": _env_differs(env, reference_manifest["env"]),
            "real_updates": result.real_updates,
        }
        write_json(self.folder / paths.TRIAL_MANIFEST, manifest)
        return manifest


ENV_DEFAULTS = {"world_size": 1, "process_group_backend": None}
"""What an env that does not name these keys means (one process): a one-rank trial of a two-rank reference differs."""


def _env_differs(env: dict, ref_env: dict) -> list[str]:
    """Keys of the environment (either side's) whose values differ between the trial and the reference."""
    return sorted(k for k in set(env) | set(ref_env) if env.get(k, ENV_DEFAULTS.get(k)) != ref_env.get(k, ENV_DEFAULTS.get(k)))


@dataclass
class Trial:
    dtype: str
    folder: Path
    manifest: dict
    trajectory: dict

    @property
    def steps(self) -> list[dict]:
        return self.trajectory["steps"]

    @property
    def final_scale(self) -> float:
        return self.trajectory["final_scale"]

    @property
    def aligned_steps(self) -> list[dict] | None:
        """FP32 with this trial's GradScaler skips skipped too (``training.aligned_fp32``), or None without skips."""
        return self.trajectory.get("aligned_fp32")

    @property
    def scaler_enabled(self) -> bool:
        return self.trajectory.get("scaler_enabled", True)

    def reader(self, name: str = "outputs") -> output_store.OutputsReader:
        """``outputs`` or ``trained_outputs``, read by slices of rows, sha256 verified."""
        file = f"{name}.safetensors"
        return output_store.OutputsReader(self.folder / file, self.manifest["files"][file], f"trial@{self.dtype}")

    def outputs(self) -> dict[str, torch.Tensor]:
        return self.reader("outputs").read_all()

    def trained_outputs(self) -> dict[str, torch.Tensor]:
        return self.reader("trained_outputs").read_all()

    def checkpoint(self) -> checkpoint.Checkpoint:
        return checkpoint.load(self.folder / paths.TRIAL_CHECKPOINT, self.manifest["files"][paths.TRIAL_CHECKPOINT])


def load(dtype: str, reference_manifest: dict | None = None) -> Trial:
    """Read a trial's manifest and trajectory (verified); outputs are read on demand, verified too.

    Raises:
        UserError: missing or damaged files, or a trial of another reference than ``reference_manifest``.
    """
    folder = paths.trial(dtype)
    manifest = read_json(folder / paths.TRIAL_MANIFEST, f"trial@{dtype}")
    if reference_manifest is not None and manifest.get("reference_run_key") != reference_manifest.get("run_key"):
        raise UserError(f"{folder} was made from another reference than data/reference; run `dvc repro trial@{dtype}`")
    sha = manifest["files"].get(paths.TRIAL_TRAJECTORY)
    if sha is not None and (folder / paths.TRIAL_TRAJECTORY).is_file() and sha256_file(folder / paths.TRIAL_TRAJECTORY) != sha:
        raise UserError(f"{folder / paths.TRIAL_TRAJECTORY} differs from its manifest (damaged or edited); run `dvc repro --force trial@{dtype}`")
    trajectory = read_json(folder / paths.TRIAL_TRAJECTORY, f"trial@{dtype}")
    return Trial(dtype=dtype, folder=folder, manifest=manifest, trajectory=trajectory)
