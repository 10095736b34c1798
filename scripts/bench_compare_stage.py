"""Peak memory of the real compare stage (``python -m pipeline compare``) on a fixed set 100 times the default.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_compare_stage.py [--scale 100] [--chunk-elements 4000000] [--keep DIR]

The built-in language model (``examples/lm.params.yaml``: 128 ordinary sequences of 32 tokens over a
96-token vocabulary, plus edge and boundary cases) is prepared, frozen and tried (bfloat16) twice, by the
real stages in fresh processes: once at the default size and once with ``--scale`` times the ordinary
sequences (training shortened: only the size of the fixed set matters here). Then ``python -m pipeline
compare --variant bfloat16`` runs in each, alone in a launcher process that reads its peak RSS
(``getrusage(RUSAGE_CHILDREN).ru_maxrss``, the child's VmHWM).

The default run's set fits in one chunk: its peak is the interpreter (Python, torch, the pipeline, every
kernel's one-time allocations) plus a few MB of outputs. The bound checked is

    peak(scaled) - peak(default) <= 2 x one chunk of every source read (reference, trial, trained, FP64),

while the scaled set's outputs are many chunks (their sizes on disk are printed beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pipeline.artifacts import comparison

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = (
    "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)"
)


def project(folder: Path, scale: int, chunk_elements: int) -> dict:
    """params.yaml of the LM example with ``scale`` x its ordinary sequences, in ``folder``."""
    params = yaml.safe_load((ROOT / "examples" / "lm.params.yaml").read_text())
    n = params["prepare"]["ordinary_cases"] * scale
    params["prepare"]["ordinary_cases"] = n
    params["task"]["options"]["n_eval"] = n
    params["reference"].update({"train_steps": 10, "checkpoint_every": 10, "replicates": 0})
    params["acceptance"].update({"loss_noise_multiple": None, "loss_noise_atol": None})
    params["compare"]["chunk_elements"] = chunk_elements
    params["threads"] = 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return params


def stage(folder: Path, *args: str) -> tuple[float, int | None]:
    """Run one stage in ``folder``; return (seconds, peak RSS in kB of the stage process)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=f"sqlite:///{folder / 'mlflow.db'}")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", LAUNCH, sys.executable, "-m", "pipeline", *args], cwd=folder, env=env,
                         capture_output=True, text=True)
    seconds = time.perf_counter() - start
    line = [x for x in out.stdout.splitlines() if x.startswith("PEAK_KB")]
    if not line or line[-1].split()[2] != "0":
        raise SystemExit(f"stage {' '.join(args)} failed in {folder}:\n{out.stdout}\n{out.stderr}")
    return seconds, int(line[-1].split()[1])


def measure(folder: Path, scale: int, chunk_elements: int) -> dict:
    project(folder, scale, chunk_elements)
    for args in (("prepare",), ("freeze",), ("trial", "--variant", "bfloat16")):
        stage(folder, *args)
    seconds, peak_kb = stage(folder, "compare", "--variant", "bfloat16")
    stats = comparison.Stats.from_dict(json.loads((folder / "data" / "compare" / "bfloat16" / comparison.STATS).read_text()))
    reference, trial = folder / "data" / "reference", folder / "data" / "trial" / "bfloat16"
    fp64 = reference / "outputs_fp64.safetensors"
    files = [reference / "outputs.safetensors", trial / "outputs.safetensors", trial / "trained_outputs.safetensors", fp64]
    sizes = {f.name if "reference" not in str(f) else "reference_" + f.name: f.stat().st_size for f in files if f.exists()}
    chunk_bytes = chunk_elements * 4 * 3 + (chunk_elements * 8 if fp64.exists() else 0)
    return {
        "scale": scale,
        "cases": stats.outputs.cases,
        "elements": sum(v.elements for v in stats.values.values()),
        "chunk_rows": stats.outputs.chunk_rows,
        "compare_seconds": seconds,
        "peak_rss_mb": peak_kb / 1024,
        "one_chunk_of_every_source_mb": chunk_bytes / 2**20,
        "output_files_mb": {k: v / 2**20 for k, v in sizes.items()},
        "kl_mean": stats.distribution.kl_mean,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument("--chunk-elements", type=int, default=4_000_000)
    parser.add_argument("--keep", default=None, help="build the projects here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-compare-stage-", dir=args.keep) as tmp:
        small = measure(Path(tmp) / "default", 1, args.chunk_elements)
        big = measure(Path(tmp) / f"x{args.scale}", args.scale, args.chunk_elements)
    above = big["peak_rss_mb"] - small["peak_rss_mb"]
    chunk = big["one_chunk_of_every_source_mb"]
    print(json.dumps({"default": small, "scaled": big}, indent=1))
    print(
        f"compare stage, {big['cases']} cases x 32 tokens x 96 ({big['elements']:.3g} elements, "
        f"{sum(big['output_files_mb'].values()):.0f} MB of outputs "
        f"in {len(big['output_files_mb'])} files, {big['chunk_rows']} rows per chunk): peak RSS {big['peak_rss_mb']:.0f} MB; "
        f"default set "
        f"({small['cases']} cases, one chunk) {small['peak_rss_mb']:.0f} MB; difference {above:.0f} MB = {above / chunk:.2f} "
        f"x one chunk of every "
        f"source ({chunk:.0f} MB); bound 2 x: {'HOLDS' if above <= 2 * chunk else 'EXCEEDED'}; "
        f"compare took {big['compare_seconds']:.1f} s"
    )


if __name__ == "__main__":
    main()
