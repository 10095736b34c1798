"""Reading the frozen FP32 reference back, with every file checked against the manifest's sha256."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import cases, checkpoint, paths
from pipeline.artifacts import read_json, read_tensors, sha256_file
from pipeline.config import Params
from pipeline.errors import UserError


@dataclass
class Reference:
    manifest: dict
    cases: cases.Cases
    outputs: dict[str, torch.Tensor]
    trajectory: list[dict]

    def checkpoint(self, name: str = "checkpoint") -> checkpoint.Checkpoint:
        path = paths.REF_CHECKPOINT if name == "checkpoint" else paths.REF_INIT
        return checkpoint.load(path, self.manifest["files"][str(path)])

    def outputs_fp64(self) -> dict[str, torch.Tensor] | None:
        sha = self.manifest["files"].get(str(paths.REF_OUTPUTS_FP64))
        if sha is None:
            return None
        return read_tensors(paths.REF_OUTPUTS_FP64, sha, "freeze")[0]


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
    outputs = read_tensors(paths.REF_OUTPUTS, files[str(paths.REF_OUTPUTS)], "freeze")[0]
    trajectory = read_json(paths.REF_TRAJECTORY, "freeze")["steps"]
    return Reference(manifest=manifest, cases=fixed, outputs=outputs, trajectory=trajectory)
