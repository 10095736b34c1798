"""The frozen FP32 reference as one typed artifact: written here, read back here, every file verified.

``write`` lays out ``data/reference/`` (initial and trained training states, the fixed set with its
boundary cases, the outputs on it, the FP64 arbiter's where the model allows, the trajectory, the FP32
noise replicate's trajectory) and writes the manifest last, with every file's sha256; ``load`` refuses a
reference frozen under another rule or from other data, and any file whose sha256 differs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from pipeline import cases, checkpoint, paths, task

from pipeline.artifacts import outputs as output_store
from pipeline.files import read_json, read_tensors, sha256_file, write_json
from pipeline.config import Params
from pipeline.errors import UserError


@dataclass
class Reference:
    manifest: dict
    cases: cases.Cases
    trajectory: list[dict]
    replicate: list[dict] | None = None
    """Per-step records of the FP32 noise replicate (``reference.noise_replicate``), or None."""

    @functools.cached_property
    def outputs(self) -> dict[str, torch.Tensor]:
        """The reference outputs whole (sha256 verified), read on first access only: diagnosis and replay use
        it; compare reads through ``outputs_reader`` and never holds them whole."""
        return read_tensors(paths.REF_OUTPUTS, self.manifest["files"][str(paths.REF_OUTPUTS)], "freeze")[0]

    def checkpoint(self, name: str = "checkpoint") -> checkpoint.Checkpoint:
        path = paths.REF_CHECKPOINT if name == "checkpoint" else paths.REF_INIT
        return checkpoint.load(path, self.manifest["files"][str(path)])

    def outputs_fp64(self) -> dict[str, torch.Tensor] | None:
        sha = self.manifest["files"].get(str(paths.REF_OUTPUTS_FP64))
        if sha is None:
            return None
        return read_tensors(paths.REF_OUTPUTS_FP64, sha, "freeze")[0]

    def outputs_reader(self) -> output_store.OutputsReader:
        """The outputs read in slices of rows (bounded memory)."""
        return output_store.OutputsReader(paths.REF_OUTPUTS, self.manifest["files"][str(paths.REF_OUTPUTS)], "freeze")

    def fp64_reader(self) -> output_store.OutputsReader | None:
        """The FP64 arbiter's outputs read in slices of rows, or None when the reference has none."""
        sha = self.manifest["files"].get(str(paths.REF_OUTPUTS_FP64))
        return output_store.OutputsReader(paths.REF_OUTPUTS_FP64, sha, "freeze") if sha else None

    def train_data(self, params: Params) -> task.TrainSource:
        """The training data the reference was trained on (tensors, or the verified Dataset)."""
        return task.load_train(params.task, paths.PREPARED_TRAIN, self.manifest["files"][str(paths.PREPARED_TRAIN)])


class NonFinite(Exception):
    """Raised by ``write`` when the reference's outputs are not finite on some cases (ids in ``args[0]``)."""


def _checked(chunks: Iterable[dict[str, torch.Tensor]], ids: list[str], bad: list[str], scan=None) -> Iterator[dict[str, torch.Tensor]]:
    row = 0
    for chunk in chunks:
        n = next(iter(chunk.values())).shape[0]
        finite = torch.ones(n, dtype=torch.bool)
        for v in chunk.values():
            finite &= torch.isfinite(v.reshape(n, -1)).all(dim=1)
        bad.extend(ids[row + i] for i in torch.nonzero(~finite).flatten().tolist())
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
    fp64: Iterable[dict[str, torch.Tensor]] | None,
    replicate: list | None,
    policy: dict,
    scan=None,
) -> dict:
    """Write the reference (manifest last) and return the manifest. ``scan`` (``vetting.Scan``) sees the
    outputs as they stream and vets the rule against them before anything replaces the previous reference.

    Raises:
        NonFinite: the FP32 outputs are not finite on some case; nothing is left in ``data/reference``.
        UserError: ``scan`` finds that the rule cannot judge this reference (``verdict.vet_rule``: an output name the model lacks, a
            tolerance as large as the output, a reference below the rule's quality, a non-finite step);
            nothing is left either.
    """
    bad: list[str] = []
    files = dict(inputs)
    pending = {path: path.with_name(f".{path.name}.pending") for path in (paths.REF_OUTPUTS, paths.REF_OUTPUTS_FP64)}
    try:  # outputs stream to pending files: a refused reference leaves the previous one untouched
        files[str(paths.REF_OUTPUTS)] = output_store.write_outputs(pending[paths.REF_OUTPUTS], _checked(outputs, fixed.ids, bad, scan), fixed.ids)
        if bad:
            raise NonFinite(sorted(set(bad)))
        problem = scan.problem([asdict(r) for r in records]) if scan is not None else None
        if problem:
            raise UserError(problem)
        if fp64 is not None:
            files[str(paths.REF_OUTPUTS_FP64)] = output_store.write_outputs(pending[paths.REF_OUTPUTS_FP64], fp64, fixed.ids)
    except BaseException:
        for path in pending.values():
            path.unlink(missing_ok=True)
        raise
    for final, path in pending.items():
        if path.exists():
            os.replace(path, final)
        elif str(final) not in files:
            final.unlink(missing_ok=True)  # no FP64 arbiter this time: drop a stale one
    files[str(paths.REF_INIT)] = checkpoint.save(paths.REF_INIT, init)
    files[str(paths.REF_CHECKPOINT)] = checkpoint.save(paths.REF_CHECKPOINT, trained)
    files[str(paths.REF_CASES)] = cases.save(paths.REF_CASES, fixed)
    write_json(paths.REF_TRAJECTORY, {"steps": [asdict(r) for r in records]})
    files[str(paths.REF_TRAJECTORY)] = sha256_file(paths.REF_TRAJECTORY)
    if replicate is not None:
        write_json(paths.REF_REPLICATE_TRAJECTORY, {"steps": [asdict(r) for r in replicate], "perturbation": "data order: first samples of consecutive updates swapped"})
        files[str(paths.REF_REPLICATE_TRAJECTORY)] = sha256_file(paths.REF_REPLICATE_TRAJECTORY)
    manifest = {
        "files": files,
        "rule_sha256": params.acceptance.sha256(),
        "run_key": run_key,
        "env": env,
        "policy": policy,
        "real_updates": real_updates,
        "cases": {"total": len(fixed.ids), **{k: fixed.kinds.count(k) for k in sorted(set(fixed.kinds))}},
        "fixed_set": fixed.meta,
    }
    write_json(paths.REF_MANIFEST, manifest)
    return manifest


def _verified_json(path: Path, files: dict) -> dict:
    sha = files.get(str(path))
    if sha is not None and Path(path).is_file() and sha256_file(path) != sha:
        raise UserError(f"{path} differs from the reference manifest (damaged or edited); restore it with `dvc checkout` or run `dvc repro --force`")
    return read_json(path, "freeze")


def load(params: Params) -> Reference:
    """Load the reference and refuse one frozen under another rule or from other data.

    Raises:
        UserError: missing or tampered files, or a rule/data hash that differs from params.yaml.
    """
    manifest = read_json(paths.REF_MANIFEST, "freeze")
    rule = params.acceptance.sha256()
    if manifest.get("rule_sha256") != rule:
        raise UserError(
            f"the acceptance rule in params.yaml (sha256 {rule[:12]}…) differs from the one frozen with the reference "
            f"({str(manifest.get('rule_sha256'))[:12]}…); the rule is fixed before the trial: run `dvc repro` to re-freeze under the new rule"
        )
    files = manifest["files"]
    for key in (str(paths.PREPARED_CASES), str(paths.PREPARED_TRAIN)):
        if not Path(key).is_file():
            raise UserError(f"{key} not found; run `dvc repro prepare`")
        if sha256_file(key) != files[key]:
            raise UserError(f"{key} differs from the data the reference was frozen on; run `dvc repro` to re-freeze")
    fixed = cases.load(paths.REF_CASES, files[str(paths.REF_CASES)], "freeze")
    trajectory = _verified_json(paths.REF_TRAJECTORY, files)["steps"]
    replicate = None
    if str(paths.REF_REPLICATE_TRAJECTORY) in files:
        replicate = _verified_json(paths.REF_REPLICATE_TRAJECTORY, files)["steps"]
    return Reference(manifest=manifest, cases=fixed, trajectory=trajectory, replicate=replicate)
