"""``python -m pipeline restore --dtype DTYPE``: restore the FP32 reference state from a rollback package."""

from __future__ import annotations

from pathlib import Path

from pipeline import rollback
from pipeline.config import load_params


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    result = rollback.restore(dtype, params, Path("restored") / f"reference-{dtype}.safetensors")
    print(f"restore {dtype}: verified {len(result['verified'])} file(s); reference state written to {result['restored']} (sha256 {result['sha256'][:12]}…)")
