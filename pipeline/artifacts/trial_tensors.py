"""The trial of one variant with its tensors (``data/trial/<variant>/``): written here, read back here, verified.

``Writer`` streams the outputs as they are computed (``pipeline.artifacts.outputs``), then writes the
training state, the trajectory, the "AMP engaged" audit (``pipeline.artifacts.audit``) and, last, the manifest
with every file's sha256 (their types live in ``pipeline.artifacts.trial``, which the torch-free stages read
alone). ``load`` gives the manifest and trajectory verified, and the outputs and checkpoint on demand, verified too.
A trial that raised under its policy is written by ``Writer.fail``: ``failure.json`` and the manifest, nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from pipeline import checkpoint, paths
from pipeline.artifacts import audit as audit_file
from pipeline.artifacts.outputs import OutputsReader, write_outputs
from pipeline.artifacts.reference import Manifest as ReferenceManifest
from pipeline.artifacts.trial import (FAILURE, Failure, Trajectory, TrialManifest, env_differs, produced_by, read_manifest,
                                     read_trajectory)
from pipeline.errors import UserError
from pipeline.files import sha256_file, write_json


class Writer:
    """Streams a trial's outputs as they are computed, then writes its state, trajectory and manifest.

    Outputs stream to pending files beside their final names and replace them only in ``finish``: a trial
    that fails half-way (a missing kernel, a kill) leaves the previous outputs as they were. Used as a
    context manager, pending files are removed when the block raises.
    """

    def __init__(self, variant: str, ids: list[str], store: str = "full") -> None:
        self.folder = paths.trial(variant)
        self.ids = ids
        self.store = store
        """``compare.store``: how per-token scores are stored (``outputs.write_outputs``)."""
        self.files: dict[str, str] = {}
        self.pending: dict[str, Path] = {}
        self.streamed: list[str] = []
        """The sinks whose outputs were all written: which part of ``training.run_trial`` a raise came from."""

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
        self.files[file] = write_outputs(self.pending[file], chunks, self.ids, store=self.store)
        self.streamed.append(name)

    @property
    def part(self) -> str:
        """What ``training.run_trial`` was doing when it raised: ``inference`` until the trained reference's outputs are
        all written, ``training`` after (the loop, then the trained model's outputs)."""
        return "training" if "outputs" in self.streamed else "inference"

    def finish(self, result, policy, reference: ReferenceManifest, env: dict, aligned: list | None,
               transforms: dict, audit: audit_file.Audit) -> TrialManifest:
        """Move the outputs into place, write the training state, the trajectory, the audit and (last) the manifest."""
        for file, path in sorted(self.pending.items()):
            os.replace(path, self.folder / file)
        self.pending.clear()
        self.files[paths.TRIAL_CHECKPOINT] = checkpoint.save(self.folder / paths.TRIAL_CHECKPOINT, result.state)
        trajectory = Trajectory(
            steps=tuple(result.records), final_scale=result.final_scale, scaler_enabled=policy.uses_scaler,
            aligned_fp32=tuple(aligned) if aligned is not None else None,
        )
        write_json(self.folder / paths.TRIAL_TRAJECTORY, trajectory.as_dict())
        self.files[paths.TRIAL_TRAJECTORY] = sha256_file(self.folder / paths.TRIAL_TRAJECTORY)
        audit_file.write(self.folder, audit)
        self.files[paths.TRIAL_AUDIT] = sha256_file(self.folder / paths.TRIAL_AUDIT)
        manifest = TrialManifest(
            files=dict(sorted(self.files.items())),
            policy=policy.as_dict(),
            reference_run_key=reference.run_key,
            rule_sha256=reference.rule_sha256,
            env=env,
            env_differs_from_reference=env_differs(env, reference.env),
            real_updates=result.real_updates,
            transforms=transforms,
        )
        write_json(self.folder / paths.TRIAL_MANIFEST, manifest.as_dict())
        return manifest


    def fail(self, failure: Failure, policy, reference: ReferenceManifest, env: dict) -> TrialManifest:
        """Write a failed trial: ``failure.json`` and (last) the manifest; what an earlier run left here goes, so that the
        folder says only that this policy raised."""
        for path in self.pending.values():
            path.unlink(missing_ok=True)
        self.pending.clear()
        for stale in (paths.TRIAL_OUTPUTS, paths.TRIAL_TRAINED_OUTPUTS, paths.TRIAL_CHECKPOINT, paths.TRIAL_TRAJECTORY,
                      paths.TRIAL_AUDIT):
            (self.folder / stale).unlink(missing_ok=True)
        write_json(self.folder / FAILURE, failure.as_dict())
        manifest = TrialManifest(
            files={FAILURE: sha256_file(self.folder / FAILURE)},
            policy=policy.as_dict(),
            reference_run_key=reference.run_key,
            rule_sha256=reference.rule_sha256,
            env=env,
            env_differs_from_reference=env_differs(env, reference.env),
            real_updates=0,
        )
        write_json(self.folder / paths.TRIAL_MANIFEST, manifest.as_dict())
        return manifest


@dataclass(frozen=True)
class Trial:
    """A trial with its tensors, read on demand (sha256 verified)."""

    variant: str
    folder: Path
    manifest: TrialManifest
    trajectory: Trajectory

    def reader(self, name: str = "outputs") -> OutputsReader:
        """``outputs`` or ``trained_outputs``, read by slices of rows, sha256 verified."""
        file = f"{name}.safetensors"
        return OutputsReader(self.folder / file, self.manifest.files[file], produced_by(self.variant))

    def outputs(self) -> dict[str, torch.Tensor]:
        return self.reader("outputs").read_all()

    def trained_outputs(self) -> dict[str, torch.Tensor]:
        return self.reader("trained_outputs").read_all()

    def checkpoint(self) -> checkpoint.Checkpoint:
        return checkpoint.load(self.folder / paths.TRIAL_CHECKPOINT, self.manifest.files[paths.TRIAL_CHECKPOINT])


def load(variant: str, reference: ReferenceManifest | None = None) -> Trial:
    """Read a trial's manifest and trajectory (verified); outputs are read on demand, verified too.

    Raises:
        UserError: missing or damaged files, or a trial of another reference than ``reference``.
    """
    manifest = read_manifest(variant)
    if manifest.failed:
        raise UserError(f"{paths.trial(variant)} is a failed trial: it raised under its policy "
                        f"({paths.trial(variant) / FAILURE}) and has no outputs to read")
    if reference is not None and manifest.reference_run_key != reference.run_key:
        raise UserError(
            f"{paths.trial(variant)} was made from another reference than data/reference; run `dvc repro {produced_by(variant)}`"
        )
    return Trial(variant=variant, folder=paths.trial(variant), manifest=manifest, trajectory=read_trajectory(variant, manifest))
