#!/usr/bin/env python3
"""GPU check: run the default pipeline, a compute-bound transformer benchmark and its compiled and float8 variants.

    python3 scripts/gpu_check.py OUT [--no-dvc] [--size auto|gpu|cpu|tiny] [--only default|transformer|variants]
                                     [--task transformer] [--dtypes float16,bfloat16]

Three runs, each in a fresh temporary copy of the project (this checkout's data/, dvc.lock and MLflow are
never touched):

- ``default``: the pipeline on params.yaml as committed, the figures every user gets first;
- ``transformer``: the same pipeline on examples/transformer.params.yaml, sized by ``--size`` (on a GPU:
  that file as it is, ~57M parameters, 64 x 256 tokens a step, so a step is compute-bound and AMP's gain is
  visible; ``cpu`` and ``tiny`` merge examples/sizes/transformer-SIZE.yaml into it);
- ``variants``: the same transformer as variants beyond autocast (docs/variants.md): ``bfloat16_inductor``
  (torch.compile) and ``float8_tensorwise`` (torchao; real FP8 kernels on capability 8.9+, emulated below, and left
  out with a note where torch or torchao cannot run it: the ROCm image's torch 2.10).

OUT/figures.json holds everything (per-stage wall time, decisions and reasons, benchmark figures with
their spread, the machine) and OUT/figures.md a summary to paste into docs/gpu.md.

Two modes:

- with DVC (``dvc`` importable and on PATH): ``git init``, ``dvc init`` and ``dvc repro`` in the copy,
  publish included (MLflow at ``MLFLOW_TRACKING_URI``, else an sqlite file inside the copy);
- without DVC (a bare PyTorch image whose python3 has only torch, pyyaml, safetensors and numpy; or
  ``--no-dvc``): dvc.yaml's commands run one by one in its order, its matrix stages once per
  ``trial.variants`` (``_project.plan``), ``publish`` skipped (MLflow is not there).

Without scikit-learn the default example (digits, which loads scikit-learn's bundled data) cannot run,
so the ``default`` run uses the transformer example at CPU size instead, and figures.json says so.
``--size tiny`` also merges examples/sizes/tiny.yaml into both runs.
``--task transformer`` forces that substitution where scikit-learn is present (the tests use it).

The whole check is meant to finish in under 8 minutes on a GPU; figures.json records the time it took.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _project

TIME_LIMIT_S = 8 * 60
# Packages a bare PyTorch image may lack whose stages only present results (plots, the MLflow mirror).
OPTIONAL = {"matplotlib", "mlflow"}
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


# --- running a project copy ----------------------------------------------------------------------------


def run_stages(repo: Path) -> list[dict]:
    """Run the stages one by one without dvc, publish skipped; stop at the first failure.

    A stage that stops because an optional package is missing (OPTIONAL: plots, the MLflow mirror) is
    recorded as skipped (nothing but publish, skipped anyway, reads what it writes); any other failure
    stops the run.
    """
    records = []
    env = _env(repo)
    for stage in _project.plan(_project.params(repo), repo):
        if stage.name == "publish":
            records.append({"stage": stage.name, "status": "skipped: MLflow mirror, not run without dvc", "seconds": 0.0})
            continue
        t0 = time.monotonic()
        proc = subprocess.run(stage.argv(), cwd=repo, env=env, capture_output=True, text=True, check=False)
        record = {
            "stage": stage.name,
            "seconds": round(time.monotonic() - t0, 2),
            "status": "ok" if proc.returncode == 0 else f"failed ({proc.returncode})",
        }
        absent = _MISSING.search(proc.stderr or "")
        if proc.returncode != 0 and absent and absent.group(1).split(".")[0] in OPTIONAL:
            record["status"] = f"skipped: needs {absent.group(1).split('.')[0]}, not installed"
        elif proc.returncode != 0:
            record["stderr"] = proc.stderr[-3000:]
        print(f"  {stage.name}: {record['status']} in {record['seconds']:.1f}s", flush=True)
        records.append(record)
        if record["status"].startswith("failed"):
            break
    return records


def _env(repo: Path) -> dict[str, str]:
    return _project.env_for(repo, os.environ.get("MLFLOW_TRACKING_URI"))  # the user's MLflow, where one is set


def run_dvc(repo: Path) -> list[dict]:
    """``git init``, ``dvc init`` and ``dvc repro`` in the copy (publish included)."""
    _project.init_repo(repo, "gpu-check")
    env = _env(repo)
    t0 = time.monotonic()
    proc = subprocess.run(_project.dvc_cmd("repro"), cwd=repo, env=env, capture_output=True, text=True, check=False)
    record = {
        "stage": "dvc repro",
        "seconds": round(time.monotonic() - t0, 2),
        "status": "ok" if proc.returncode == 0 else f"failed ({proc.returncode})",
    }
    print(f"  dvc repro: {record['status']} in {record['seconds']:.1f}s", flush=True)
    if proc.returncode != 0:
        record["stderr"] = (proc.stderr or proc.stdout)[-3000:]
    return [record]


def collect(repo: Path, dtypes: list[str]) -> dict:
    """Decisions, compare metrics and benchmark figures of a finished (or stopped) run."""

    def read(path: Path) -> Any:
        return json.loads(path.read_text()) if path.is_file() else None

    out: dict = {"decisions": {}, "compare": {}, "benchmark": {}}
    manifest = read(repo / "data/reference/manifest.json")
    out["env"] = manifest.get("env") if manifest else None
    for d in dtypes:
        decision = read(repo / f"data/decision/{d}/decision.json")
        if decision:
            out["decisions"][d] = {"decision": decision["decision"], "reasons": decision["reasons"]}
        out["compare"][d] = read(repo / f"data/metrics/{d}.json")  # decide's short metrics: flips, gaps, quality
        bench = read(repo / f"data/benchmark/{d}/benchmark.json")
        if bench:
            out["benchmark"][d] = bench
    return out


# --- the check ------------------------------------------------------------------------------------------


def profiles(size: str, only: str | None, force_transformer: bool, dtypes: list[str] | None) -> tuple[dict, dict[str, str]]:
    """The params of each run, and notes on what was substituted and why."""
    notes: dict[str, str] = {}
    chosen = {"trial": {"variants": dtypes}} if dtypes else {}
    transformer = _project.merge(_project.transformer(size), chosen)
    default = _project.merge(_project.merge(_project.params(), _project.size("tiny") if size == "tiny" else {}), chosen)
    if force_transformer or importlib.util.find_spec("sklearn") is None:
        small = "tiny" if size == "tiny" else "cpu"
        default = _project.merge(_project.transformer(small), chosen)
        why = "--task transformer" if force_transformer else "scikit-learn is not installed (the digits example needs it)"
        notes["default"] = f"{why}: ran the transformer example at {small} size instead of params.yaml's task"
    variants, why = variant_names()
    if why:
        notes["variants"] = why
    runs = {"default": default, "transformer": transformer,
            "variants": _project.merge(_project.transformer(size), {"trial": {"variants": variants}})}
    return ({only: runs[only]} if only else runs), notes


def variant_names() -> tuple[list[str], str]:
    """The variants run beyond autocast here, and why float8 is left out where it is."""
    names = ["bfloat16_inductor", "float8_tensorwise"]
    try:
        import torch

        from pipeline.transforms import FLOAT8_MIN_TORCH
    except ImportError:
        return names, ""
    if tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2]) < FLOAT8_MIN_TORCH:
        return names[:1], f"float8_tensorwise left out: torch {torch.__version__} is older than torchao 0.18 supports"
    if importlib.util.find_spec("torchao") is None:
        return names[:1], "float8_tensorwise left out: torchao is not installed (pip install '.[fp8]')"
    return names, ""


def detect_size() -> str:
    try:
        import torch
    except ImportError:
        sys.exit("gpu_check: torch is not importable by this python; run it inside the image")
    return "gpu" if torch.cuda.is_available() else "cpu"


def markdown(figures: dict) -> str:
    """The figures as a short Markdown summary: one table per run, one row per variant."""
    lines = [f"GPU check, {figures['mode']} mode, size {figures['size']}, {figures['total_seconds']:.0f} s in all.", ""]
    columns = ["variant", "decision", "FP32 s/step", "AMP s/step", "speedup vs FP32 (IQR)", "vs TF32 (IQR)"]
    header = "| " + " | ".join([*columns, "peak memory AMP/FP32 (IQR)", "rounds"]) + " |"
    for name, run in figures["runs"].items():
        env = run.get("env") or {}
        machine = f"{env.get('device_name', '?')} ({env.get('backend', '?')}, capability {env.get('capability', '?')}"
        lines += [
            f"**{name}** on {machine}, torch {env.get('torch', '?')})" + (f": {run['note']}" if run.get("note") else ""),
            "",
        ]
        lines += [header, "|---|---|---|---|---|---|---|---|"]
        for dtype, dec in run["decisions"].items():
            b = run["benchmark"].get(dtype) or {}
            if not b.get("benchmarked"):
                lines.append(f"| {dtype} | {dec['decision']} | | | not benchmarked | | | |")
                continue
            if not b.get("speedup"):
                why = b.get("no_speedup_because") or "no speedup"
                lines.append(f"| {dtype} | {dec['decision']} | | | {why} | | | |")
                continue
            sec, method = b["seconds_per_step"], b["method"]
            cells = [
                dtype,
                dec["decision"],
                f"{sec['fp32']['median']:.4g}",
                f"{sec['amp']['median']:.4g}",
                _ratio(b.get("speedup")),
                _ratio(b.get("speedup_vs_tf32")),
                _ratio(b.get("memory_ratio")),
                f"{method['repeats']} x {method['steps_per_repeat']} steps"
                + (f", compile {b['compile_seconds']:.1f} s apart" if b.get("compile_seconds") is not None else ""),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _ratio(s: dict | None) -> str:
    return f"x{s['median']:.2f} ({s['q1']:.2f}-{s['q3']:.2f})" if s else "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for figures.json and figures.md")
    parser.add_argument(
        "--no-dvc", action="store_true", help="run the stages' commands from dvc.yaml without dvc (publish skipped)"
    )
    parser.add_argument(
        "--size",
        choices=("auto", "gpu", "cpu", "tiny"),
        default="auto",
        help="transformer size (auto: gpu if CUDA/ROCm is visible)",
    )
    parser.add_argument("--only", choices=("default", "transformer", "variants"), help="run one of the three runs")
    parser.add_argument(
        "--task", choices=("transformer",), help="default run on the transformer example even where scikit-learn exists"
    )
    parser.add_argument("--dtypes", help="comma-separated trial.variants override, e.g. float16")
    parser.add_argument("--keep", action="store_true", help="keep the temporary project copies (their paths are printed)")
    parser.add_argument(
        "--require-gpu", action="store_true", help="stop with one line (exit 2) unless torch sees a CUDA or ROCm GPU"
    )
    args = parser.parse_args(argv)

    if args.require_gpu and detect_size() != "gpu":
        print("gpu_check: --require-gpu, but torch.cuda.is_available() is False: run it inside the GPU image with the GPU "
              "passed through (docker run --gpus all, or ROCm's --device=/dev/kfd --device=/dev/dri)", file=sys.stderr)
        return 2
    size = detect_size() if args.size == "auto" else args.size
    use_dvc = not args.no_dvc and shutil.which("dvc") is not None and importlib.util.find_spec("dvc") is not None
    dtypes = args.dtypes.split(",") if args.dtypes else None
    runs, notes = profiles(size, args.only, args.task == "transformer", dtypes)
    figures: dict = {
        "mode": "dvc" if use_dvc else "stages (no dvc)",
        "size": size,
        "python": platform.python_version(),
        "runs": {},
    }
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    ok = True
    try:
        for name, params in runs.items():
            print(f"gpu_check: run {name} ({figures['mode']}, size {size})", flush=True)
            repo = _project.copy(work / name, params)
            t0 = time.monotonic()
            stages = run_dvc(repo) if use_dvc else run_stages(repo)
            run_dtypes = params["trial"]["variants"]
            figures["runs"][name] = {
                "note": notes.get(name, ""),
                "params": params,
                "seconds": round(time.monotonic() - t0, 2),
                "stages": stages,
                **collect(repo, run_dtypes),
            }
            ok = ok and all(not s["status"].startswith("failed") for s in stages)
    finally:
        figures["total_seconds"] = round(time.monotonic() - start, 2)
        figures["within_time_limit"] = figures["total_seconds"] <= TIME_LIMIT_S
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "figures.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
        (args.out / "figures.md").write_text(markdown(figures))
        if args.keep:
            print(f"gpu_check: project copies kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(figures))
    print(f"gpu_check: figures in {args.out}/figures.json ({figures['total_seconds']:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
