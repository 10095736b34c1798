"""``python -m pipeline restore --variant NAME``: restore the FP32 reference state from a rollback package.

Not a DVC stage: a command a user runs after a rollback. Every hash is checked before anything is loaded.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import checkpoint, paths, task

from pipeline.artifacts import rollback
from pipeline.config import load_params


def main(variant: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    files = rollback.verified_files(variant)
    ckpt = checkpoint.load(paths.REF_CHECKPOINT, files[str(paths.REF_CHECKPOINT)])
    model = task.build_model(params.task, params.seed)
    checkpoint.restore(ckpt, model, rng=True)  # proves the state loads into the model
    target = Path("restored") / f"reference-{variant}.safetensors"
    sha = checkpoint.save(target, ckpt)
    print(f"restore {variant}: verified {len(files)} file(s); reference state written to {target} (sha256 {sha[:12]}…)")
