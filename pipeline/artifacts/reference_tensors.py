"""The frozen FP32 reference with its tensors: written here, read back here, every file verified.

``write`` lays out ``data/reference/`` (initial and trained training states, the fixed set with its
boundary cases, the outputs on it, the FP64 arbiter's on its first ``reference.fp64_arbiter`` cases where the
model allows, the trajectory, the FP32 noise replicate's trajectory, the FP16 headroom forecast) and writes the manifest
(``pipeline.artifacts.reference.Manifest``) last, with every file's sha256; ``load`` refuses a reference frozen
under another rule or from other data, and any file whose sha256 differs. The stages that train, infer or replay
read it here; the others read the manifest, trajectories and forecast through ``pipeline.artifacts.reference`` alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from pipeline import cases, checkpoint, paths, task
from pipeline.artifacts import forecast as forecast_file
from pipeline.artifacts.outputs import OutputsReader, write_outputs
from pipeline.artifacts.steps import Steps
from pipeline.artifacts.comparison import FP32Spread
from pipeline.artifacts.reference import PRODUCED_BY, Manifest, Trajectory, read_manifest, read_replicates, read_trajectory
from pipeline.config import Params, ReferenceConfig
from pipeline.errors import UserError
from pipeline.files import StagedFolder, sha256_file, write_json

if TYPE_CHECKING:  # the stages that only load a reference need none of inference's imports
    from pipeline.inference import Fp64Outputs


@dataclass(frozen=True)
class Reference:
    """The reference with its tensors: the stages that train, infer or replay read it through ``load``."""

    manifest: Manifest
    cases: cases.Cases
    trajectory: Steps
    replicates: tuple[Steps, ...] = ()
    """Per-step records of each FP32 noise replicate (``reference.replicates``), the first first."""
    spread: FP32Spread | None = None
    """The replicates' quality after training beside the reference's: FP32's own spread (None without a replicate)."""

    @property
    def replicate(self) -> Steps | None:
        """The first replicate's records (the noise floor's per-step gap), or None without one."""
        return self.replicates[0] if self.replicates else None

    @functools.cached_property
    def outputs(self) -> dict[str, torch.Tensor]:
        """The reference outputs whole (sha256 verified), read on first access only: diagnosis and replay use
        it; compare reads through ``outputs_reader`` and never holds them whole."""
        return self.outputs_reader().read_all()  # decoded, whichever store (``compare.store``) wrote them

    def checkpoint(self, name: str = "checkpoint") -> checkpoint.Checkpoint:
        path = paths.REF_CHECKPOINT if name == "checkpoint" else paths.REF_INIT
        return checkpoint.load(path, self.manifest.sha256(path))

    def model(self, params: Params, name: str = "checkpoint") -> torch.nn.Module:
        """The task's model in the reference's trained state (``checkpoint``: weights only) or at its start (``init``:
        weights and the RNG its training started from)."""
        model = task.build_model(params.task, params.seed)
        checkpoint.restore(self.checkpoint(name), model, rng=name == "init")
        return model

    def outputs_reader(self) -> OutputsReader:
        """The outputs read in slices of rows (bounded memory): one reader, its file's sha256 verified once, for every
        pass over them (diagnose compares again at each re-run; an LM's file is GBs)."""
        return self._outputs_file

    def fp64_reader(self) -> OutputsReader | None:
        """The FP64 arbiter's outputs read in slices of rows, or None when the reference has none (verified once too)."""
        return self._fp64_file

    @functools.cached_property
    def _outputs_file(self) -> OutputsReader:
        return OutputsReader(paths.REF_OUTPUTS, self.manifest.sha256(paths.REF_OUTPUTS), PRODUCED_BY)

    @functools.cached_property
    def _fp64_file(self) -> OutputsReader | None:
        sha = self.manifest.sha256(paths.REF_OUTPUTS_FP64)
        return OutputsReader(paths.REF_OUTPUTS_FP64, sha, PRODUCED_BY) if sha else None

    def batch_hashes(self, world_size: int) -> list[str] | None:
        """The sha256 of every batch the reference read, step by step, for a trial of the same world size to
        compare with its own; None for another world size, whose ranks draw other batches."""
        if self.manifest.env.get("world_size", 1) != world_size:
            return None
        return [s.batch_sha256 for s in self.trajectory]

    def train_data(self, params: Params) -> task.TrainSource:
        """The training data the reference was trained on (tensors, or the verified Dataset)."""
        return task.load_train(params.task, paths.PREPARED_TRAIN, self.manifest.sha256(paths.PREPARED_TRAIN))


class NonFinite(UserError):
    """Raised by ``write`` when the reference's outputs are not finite on some cases (``ids``)."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        super().__init__(
            f"the FP32 reference is not finite on {len(ids)} case(s) ({', '.join(ids[:5])}); an incorrect FP32 run "
            f"is no baseline: fix the model, data or prepare.edge_scales, then rerun"
        )


def _checked(
    chunks: Iterable[dict[str, torch.Tensor]], ids: list[str], bad: list[str], scan=None
) -> Iterator[dict[str, torch.Tensor]]:
    """The chunks, the ids of their rows with a non-finite output gathered into ``bad``: where compare judges it
    (``scan.nonfinite_rows``: a padding position, or -inf beside a finite maximum of class scores, a masked class, is no
    fault), every element without a ``scan``."""
    row = 0
    for chunk in chunks:
        n = next(iter(chunk.values())).shape[0]
        if scan is not None:
            broken = scan.nonfinite_rows(row, chunk)
        else:
            broken = torch.zeros(n, dtype=torch.bool)
            for v in chunk.values():
                broken |= ~torch.isfinite(v.reshape(n, -1)).all(dim=1)
        bad.extend(ids[row + i] for i in torch.nonzero(broken).flatten().tolist())
        if scan is not None and not bad:
            scan.update(row, chunk)
        row += n
        yield chunk


def write(
    *,
    params: Params,
    inputs: dict[str, str],
    run_key: str,
    env: dict,
    init: checkpoint.Checkpoint,
    trained: checkpoint.Checkpoint,
    records: list,
    real_updates: int,
    fixed: cases.Cases,
    outputs: Iterable[dict[str, torch.Tensor]],
    fp64: Fp64Outputs | None,
    replicates: list[list],
    policy: dict,
    forecast: forecast_file.Headroom,
    scan=None,
    replicate_outputs: Iterable[Iterable[dict[str, torch.Tensor]]] = (),
) -> Manifest:
    """Write the reference (manifest last) and return the manifest. ``scan`` (``vetting.Scan``) sees the
    outputs as they stream and vets the rule against them before anything replaces the previous reference.

    Raises:
        NonFinite: the FP32 outputs are not finite on some case (a UserError); nothing of it is left, and the
            previous ``data/reference`` stays as it was (``files.StagedFolder``).
        UserError: ``scan`` finds that the rule cannot judge this reference (``refusals.problem``: an output name
            the model lacks, a tolerance as large as the output, a reference below the rule's quality, a non-finite
            step); nothing of it is left either.
        DiskFull: the filesystem filled up; the previous reference stays as it was.
    """
    bad: list[str] = []
    files = dict(inputs)
    with StagedFolder(paths.REFERENCE) as out:  # the new reference beside the old: a refused one leaves the old untouched
        def staged(path):  # the manifest names each file where it will be: data/reference/NAME
            return out / path.relative_to(paths.REFERENCE)

        files[str(paths.REF_OUTPUTS)] = write_outputs(
            staged(paths.REF_OUTPUTS), _checked(outputs, fixed.ids, bad, scan), fixed.ids, store="full", task=params.task
        )  # always full: a compact trial keeps its per-token KL against these exact scores (the FP64 arbiter's too)
        if bad:
            raise NonFinite(sorted(set(bad)))
        spread = _spread(scan, replicate_outputs)
        problem = scan.problem(records, replicates, spread) if scan is not None else None
        if problem:
            raise UserError(problem)
        if fp64 is not None:
            files[str(paths.REF_OUTPUTS_FP64)] = write_outputs(
                staged(paths.REF_OUTPUTS_FP64), fp64.chunks, fixed.ids[: fp64.cases]
            )  # the fixed set's first cases (reference.fp64_arbiter), each under its id
        files[str(paths.REF_INIT)] = checkpoint.save(staged(paths.REF_INIT), init)
        files[str(paths.REF_CHECKPOINT)] = checkpoint.save(staged(paths.REF_CHECKPOINT), trained)
        files[str(paths.REF_CASES)] = cases.save(staged(paths.REF_CASES), fixed)
        write_json(staged(paths.REF_TRAJECTORY), Trajectory(steps=tuple(records)).as_dict())
        files[str(paths.REF_TRAJECTORY)] = sha256_file(staged(paths.REF_TRAJECTORY))
        if replicates:
            write_json(staged(paths.REF_REPLICATE_TRAJECTORY), Trajectory(
                steps=tuple(replicates[0]), perturbation="data order: the k-th replicate trades the k-th block of samples of "
                "each pair of consecutive updates", quality=spread, more=tuple(tuple(r) for r in replicates[1:]) or None,
            ).as_dict())
            files[str(paths.REF_REPLICATE_TRAJECTORY)] = sha256_file(staged(paths.REF_REPLICATE_TRAJECTORY))
        forecast_file.write(out, forecast)
        files[str(paths.REF_FORECAST)] = sha256_file(staged(paths.REF_FORECAST))
        manifest = Manifest(
            files=files,
            rule_sha256=params.acceptance.sha256(),
            run_key=run_key,
            env=env,
            policy=policy,
            real_updates=real_updates,
            cases={"total": len(fixed.ids), **{k: fixed.kinds.count(k) for k in sorted(set(fixed.kinds))}},
            fixed_set=fixed.meta,
            roles=scan.roles().as_dict() if scan is not None else {},
        )
        write_json(staged(paths.REF_MANIFEST), manifest.as_dict())
    return manifest


def load(params: Params) -> Reference:
    """Load the reference and refuse one frozen under another rule or from other data.

    Raises:
        UserError: missing or tampered files, or a rule/data hash that differs from params.yaml.
    """
    manifest = read_manifest()
    manifest.check_rule(params.acceptance)
    for key in (paths.PREPARED_CASES, paths.PREPARED_TRAIN):
        if not key.is_file():
            raise UserError(f"{key} not found; run `dvc repro prepare`")
        if sha256_file(key) != manifest.sha256(key):
            raise UserError(f"{key} differs from the data the reference was frozen on; run `dvc repro` to re-freeze")
    fixed = cases.load(paths.REF_CASES, manifest.sha256(paths.REF_CASES), PRODUCED_BY)
    run = read_replicates(manifest)  # read and verified once: the replicates' steps and their quality
    return Reference(manifest=manifest, cases=fixed, trajectory=read_trajectory(manifest),
                     replicates=() if run is None else (run.steps, *(run.more or ())), spread=run and run.quality)


def _spread(scan, replicate_outputs: Iterable[Iterable[dict[str, torch.Tensor]]]) -> FP32Spread | None:
    """The replicates' quality after training beside the reference's, each streamed through ``scan`` (``vetting.Scan``)
    after the reference's outputs, in the same metric and reading; None without a replicate, a scan or a finite quality."""
    if scan is None:
        return None
    for k, outputs in enumerate(replicate_outputs):
        row = 0
        for chunk in outputs:
            scan.update_replicate(k, row, chunk)
            row += next(iter(chunk.values())).shape[0]
    found = scan.replicate_quality()
    return None if found is None else FP32Spread(metric=scan.metric.name, reference=found[0], replicates=tuple(found[1]))


def run_key(params: Params, inputs: dict[str, str], init: checkpoint.Checkpoint) -> str:
    """The reference's identity: params, prepared inputs, the initial weights (a pretrained directory's too)
    and the source of the task's own modules. The resume state adds the pipeline's code, the thread counts
    and the world size (``checkpoint.ResumeFile``)."""
    blob = json.dumps({**_recipe(params), "inputs": inputs, "init": checkpoint.tensors_digest(init.tensors)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def recipe_key(params: Params) -> str:
    """What trains a run besides its inputs and initial weights, as params say now: the seed, the task (its own
    modules' source: the model, the data, a custom loss, metric or optimizer) and the recipe. A trial's resume key
    holds it: params edited after freeze (an lr, a loss module) and the trial run alone must not resume a state that
    was trained under the old ones."""
    return hashlib.sha256(json.dumps(_recipe(params), sort_keys=True).encode()).hexdigest()


def _recipe(params: Params) -> dict:
    code = task.source_digest(task.entry_points(params.task, params.reference.optimizer))
    return {"seed": params.seed, "task": asdict(params.task), "reference": _trained_by(params.reference), "code": code}


def _trained_by(cfg: ReferenceConfig) -> dict:
    """The reference params that shape its training and fixed set, for its run key: the FP64 arbiter's size
    changes neither, so resizing it keeps the trials' resume states."""
    return {k: v for k, v in asdict(cfg).items() if k != "fp64_arbiter"}
