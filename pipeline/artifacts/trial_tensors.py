"""The trial of one variant with its tensors (``data/trial/<variant>/``): written here, read back here, verified.

``Writer`` streams the outputs as they are computed (``pipeline.artifacts.outputs``), then writes the
training state, the trajectory, the "AMP engaged" audit (``pipeline.artifacts.audit``) and, last, the manifest
with every file's sha256 (their types live in ``pipeline.artifacts.trial``, which the torch-free stages read
alone). ``load`` gives the manifest and trajectory verified, and the outputs and checkpoint on demand, verified too.
A trial that raised under its policy is written by ``Writer.fail``: ``failure.json`` and the manifest, nothing else.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from pipeline import checkpoint, paths
from pipeline.artifacts import audit as audit_file
from pipeline.artifacts.outputs import KlAgainst, OutputsReader, write_outputs
from pipeline.artifacts.reference import Manifest as ReferenceManifest
from pipeline.artifacts.trial import (FAILURE, Failure, Trajectory, TrialManifest, env_differs, produced_by, read_manifest,
                                     read_trajectory)
from pipeline.config import TaskConfig
from pipeline.errors import UserError
from pipeline.files import StagedFolder, sha256_file, write_json


class Writer:
    """Streams a trial's outputs as they are computed, then writes its state, trajectory and manifest.

    Every file goes to the folder's next content, beside it (``files.StagedFolder``), which replaces the folder as a
    whole in ``finish`` (or ``fail``): a trial that fails half-way (a missing kernel, a kill, a full disk) leaves the
    previous trial as it was, never a mix. Used as a context manager, the pending folder goes when the block raises.
    """

    def __init__(self, variant: str, ids: list[str], store: str = "full", task: TaskConfig | None = None,
                 reference: Callable[[], OutputsReader] | None = None, kl: Callable | None = None) -> None:
        self.folder = paths.trial(variant)
        self.ids = ids
        self.store, self.task = store, task
        """``compare.store`` and the task: how per-token scores are stored, what the compact form keeps exactly
        (``outputs.write_outputs``)."""
        self.kl_against = KlAgainst(reference, kl) if reference is not None and kl is not None else None
        """The reference's outputs (``reference_tensors.Reference.outputs_reader``, opened where an output is compacted)
        and KL's definition (``decisions.token_kl``): a compacted ``outputs`` keeps each token's KL against the
        reference's full scores, which compare reads (``compact.KL``)."""
        self.files: dict[str, str] = {}
        self.staged: StagedFolder | None = None
        """The folder's next content, made at the first write (rank 0 alone writes under torchrun)."""
        self.streamed: list[str] = []
        """The sinks whose outputs were all written: which part of ``training.run_trial`` a raise came from."""

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, typ, exc, tb) -> None:
        if exc is not None and self.staged is not None:
            self.staged.discard(exc)  # a full disk: one line (files.DiskFull)

    def _staged(self) -> StagedFolder:
        if self.staged is None:
            self.staged = StagedFolder(self.folder)
        return self.staged

    def sink(self, name: str, chunks: Iterable[dict[str, torch.Tensor]] | None) -> None:
        """``name`` is ``outputs`` or ``trained_outputs`` (what ``training.run_trial`` streams); ``chunks`` None: the
        ``outputs`` just written, copied byte for byte (an inference-only trial's trained model is the one inferred)."""
        file = f"{name}.safetensors"
        if chunks is None:
            shutil.copyfile(self._staged().path / paths.TRIAL_OUTPUTS, self._staged().path / file)
            self.files[file] = self.files[paths.TRIAL_OUTPUTS]
            self.streamed.append(name)
            return
        against = self.kl_against if name == "outputs" else None  # (compare's KL: the reference against this inference)
        self.files[file] = write_outputs(self._staged().path / file, chunks, self.ids, store=self.store,
                                         task=self.task, kl_against=against)
        self.streamed.append(name)

    @property
    def part(self) -> str:
        """What ``training.run_trial`` was doing when it raised: ``inference`` until the trained reference's outputs are
        all written, ``training`` after (the loop, then the trained model's outputs)."""
        return "training" if "outputs" in self.streamed else "inference"

    def finish(self, result, policy, reference: ReferenceManifest, env: dict, aligned: list | None,
               transforms: dict, audit: audit_file.Audit) -> TrialManifest:
        """Write the training state, the trajectory, the audit and (last) the manifest beside the streamed outputs, then
        put the whole set in place of the previous one."""
        with self._staged() as out:
            self.files[paths.TRIAL_CHECKPOINT] = checkpoint.save(out / paths.TRIAL_CHECKPOINT, result.state)
            trajectory = Trajectory(
                steps=tuple(result.records), final_scale=result.final_scale, scaler_enabled=policy.uses_scaler,
                aligned_fp32=tuple(aligned) if aligned is not None else None,
            )
            write_json(out / paths.TRIAL_TRAJECTORY, trajectory.as_dict())
            self.files[paths.TRIAL_TRAJECTORY] = sha256_file(out / paths.TRIAL_TRAJECTORY)
            audit_file.write(out, audit)
            self.files[paths.TRIAL_AUDIT] = sha256_file(out / paths.TRIAL_AUDIT)
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
            write_json(out / paths.TRIAL_MANIFEST, manifest.as_dict())
        return manifest

    def fail(self, failure: Failure, policy, reference: ReferenceManifest, env: dict) -> TrialManifest:
        """Write a failed trial: ``failure.json`` and (last) the manifest, nothing else, in place of what an earlier run
        left here: the folder says only that this policy raised."""
        if self.staged is not None:
            self.staged.discard()  # the outputs streamed before it raised
        self.staged = None
        with self._staged() as out:
            write_json(out / FAILURE, failure.as_dict())
            manifest = TrialManifest(
                files={FAILURE: sha256_file(out / FAILURE)},
                policy=policy.as_dict(),
                reference_run_key=reference.run_key,
                rule_sha256=reference.rule_sha256,
                env=env,
                env_differs_from_reference=env_differs(env, reference.env),
                real_updates=0,
            )
            write_json(out / paths.TRIAL_MANIFEST, manifest.as_dict())
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
