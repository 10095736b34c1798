#!/usr/bin/env python3
"""GPU check: run the default pipeline and a compute-bound transformer benchmark, and write the figures.

    python3 scripts/gpu_check.py OUT [--no-dvc] [--size auto|gpu|cpu|tiny] [--only default|transformer]
                                     [--task transformer] [--dtypes float16,bfloat16]

Two runs, each in a fresh temporary copy of the project (this checkout's data/, dvc.lock and MLflow are
never touched):

- ``default``: the pipeline on params.yaml as committed, the figures every user gets first;
- ``transformer``: the same pipeline on the built-in transformer example, sized by ``--size`` (on a GPU:
  ~57M parameters, 64 x 256 tokens a step, so a step is compute-bound and AMP's gain is visible).

OUT/figures.json holds everything (per-stage wall time, decisions and reasons, benchmark figures with
their spread, the machine) and OUT/figures.md a summary to paste into the README.

Two modes:

- with DVC (``dvc`` importable and on PATH): ``git init``, ``dvc init`` and ``dvc repro`` in the copy,
  publish included (MLflow at ``MLFLOW_TRACKING_URI``, else an sqlite file inside the copy);
- without DVC (a bare PyTorch image whose python3 has only torch, pyyaml, safetensors and numpy; or
  ``--no-dvc``): the stages run one by one as ``python -m pipeline STAGE [--dtype D]``, in the package's
  own order (``pipeline.__main__.STAGES``, per-dtype stages once per ``trial.dtypes``), ``publish``
  skipped (MLflow is not there). dvc.yaml is not read: what it would run is what the package runs.

Without scikit-learn the default example (digits, which loads scikit-learn's bundled data) cannot run,
so the ``default`` run uses the transformer example at CPU size instead, and figures.json says so.
``--task transformer`` forces that substitution where scikit-learn is present (the tests use it).

The whole check is meant to finish in under 8 minutes on a GPU; figures.json records the time it took.
"""

from __future__ import annotations

import argparse
import copy
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package's stage order, whatever the current folder

from pipeline.__main__ import PER_DTYPE, STAGES  # noqa: E402  (imports only the params loader: no torch)

PROJECT_FILES = ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore")
TIME_LIMIT_S = 8 * 60
# Packages a bare PyTorch image may lack whose stages only present results (plots, the MLflow mirror).
OPTIONAL = {"matplotlib", "mlflow"}
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
TRANSFORMER = "pipeline.examples.transformer"

# The transformer example at three sizes. The GPU size makes every matmul large enough for tensor cores
# (d_model 768, 64 x 256 tokens a step): strict FP32 then costs several times an AMP step.
TRANSFORMER_OPTIONS = {
    "gpu": {"seq_len": 256, "features": 32, "d_model": 768, "heads": 12, "layers": 8, "n_train": 2048, "n_eval": 256},
    "cpu": {"seq_len": 32, "features": 16, "d_model": 64, "heads": 4, "layers": 2, "n_train": 2048, "n_eval": 256},
    "tiny": {"seq_len": 16, "features": 8, "d_model": 32, "heads": 2, "layers": 1, "n_train": 256, "n_eval": 64},
}
# Adam learns this task within the reference's steps where the digits example's SGD settings do not. No
# resumable checkpoints: on the GPU size each would hold ~0.7 GB of weights and Adam state.
TRANSFORMER_REFERENCE = {
    "gpu": {"optimizer": "adam", "lr": 1.0e-3, "batch_size": 64, "checkpoint_every": 0},
    "cpu": {"optimizer": "adam", "lr": 1.0e-3, "batch_size": 64, "checkpoint_every": 0},
    "tiny": {"optimizer": "adam", "lr": 3.0e-3, "batch_size": 32, "checkpoint_every": 0, "train_steps": 40},
}
# The rule for the transformer runs, fixed here before any trial runs: params.yaml's rule except the
# quality floor, set for a 4-class task (chance is 0.25). Drops against the reference, flips, value
# tolerances and the training checks stay as committed.
TRANSFORMER_ACCEPTANCE = {"min_quality": 0.5}
# Small enough that a whole run takes seconds on a CPU; the same stages and code paths (tests use it).
TINY = {
    "prepare": {"ordinary_cases": 64, "edge_samples": 2},
    "reference": {"train_steps": 12, "batch_size": 32, "checkpoint_every": 0, "boundary_cases": 3},
    "bench": {"warmup": 1, "repeats": 3, "steps": 2},
}


@dataclass
class Stage:
    name: str
    args: list[str] = field(default_factory=list)


NOT_DVC_STAGES = {"restore"}  # a command users run after a rollback, not a stage of dvc.yaml


def plan(params: dict) -> list[Stage]:
    """The DVC stages in the package's order, per-dtype ones once per ``trial.dtypes`` (``trial@float16`` ...)."""
    dtypes = params.get("trial", {}).get("dtypes", [])
    out = []
    for name in (s for s in STAGES if s not in NOT_DVC_STAGES):
        if name in PER_DTYPE:
            out += [Stage(f"{name}@{d}", [name, "--dtype", d]) for d in dtypes]
        else:
            out.append(Stage(name, [name]))
    return out


# --- running a project copy ----------------------------------------------------------------------------


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def make_copy(dest: Path, override: dict) -> Path:
    """The project's pipeline files in ``dest``, params.yaml with ``override`` merged in."""
    dest.mkdir(parents=True)
    for name in PROJECT_FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "pipeline", dest / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((dest / "params.yaml").read_text())
    (dest / "params.yaml").write_text(yaml.safe_dump(merge(params, override), sort_keys=False))
    return dest


def _env(repo: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONUNBUFFERED="1")
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{repo / 'mlflow.db'}")
    env.pop("DVC_EXP_NAME", None)
    return env


def run_stages(repo: Path) -> list[dict]:
    """Run the stages one by one without dvc, publish skipped; stop at the first failure.

    A stage that stops because an optional package is missing (OPTIONAL: plots, the MLflow mirror) is
    recorded as skipped (nothing but publish, skipped anyway, reads what it writes); any other failure
    stops the run.
    """
    records = []
    for stage in plan(yaml.safe_load((repo / "params.yaml").read_text())):
        if stage.name == "publish":
            records.append({"stage": stage.name, "status": "skipped: MLflow mirror, not run without dvc", "seconds": 0.0})
            continue
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pipeline", *stage.args], cwd=repo, env=_env(repo), capture_output=True, text=True, check=False)
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


def run_dvc(repo: Path) -> list[dict]:
    """``git init``, ``dvc init`` and ``dvc repro`` in the copy (publish included)."""
    env = _env(repo)
    for args in (
        ["git", "init", "-q"],
        [
            "git",
            "-c",
            "user.name=gpu-check",
            "-c",
            "user.email=gpu-check@localhost",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "empty",
        ],
        ["dvc", "init", "-q"],
        ["dvc", "config", "core.analytics", "false"],
    ):
        subprocess.run(args, cwd=repo, env=env, check=True, capture_output=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True, capture_output=True)
    subprocess.run(
        ["git", "-c", "user.name=gpu-check", "-c", "user.email=gpu-check@localhost", "commit", "-qm", "copy"],
        cwd=repo,
        env=env,
        check=True,
        capture_output=True,
    )
    t0 = time.monotonic()
    proc = subprocess.run(["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True, check=False)
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


def profiles(
    size: str, only: str | None, force_transformer: bool, dtypes: list[str] | None
) -> tuple[dict[str, dict], dict[str, str]]:
    """Params overrides of each run, and notes on what was substituted and why."""
    notes: dict[str, str] = {}
    base: dict = merge(TINY, {}) if size == "tiny" else {}
    if dtypes:
        base["trial"] = {"dtypes": dtypes}
    transformer = merge(
        base,
        {
            "task": {
                "kind": "classification",
                "model": f"{TRANSFORMER}:build_model",
                "data": f"{TRANSFORMER}:load_data",
                "options": TRANSFORMER_OPTIONS[size],
                "loss": "cross_entropy",
            },
            "reference": TRANSFORMER_REFERENCE[size],
            "acceptance": TRANSFORMER_ACCEPTANCE,
        },
    )
    default = copy.deepcopy(base)
    if force_transformer or importlib.util.find_spec("sklearn") is None:
        small = "tiny" if size == "tiny" else "cpu"
        default = merge(transformer, {"task": {"options": TRANSFORMER_OPTIONS[small]}, "reference": TRANSFORMER_REFERENCE[small]})
        why = "--task transformer" if force_transformer else "scikit-learn is not installed (the digits example needs it)"
        notes["default"] = f"{why}: ran the transformer example at {small} size instead of params.yaml's task"
    runs = {"default": default, "transformer": transformer}
    return ({only: runs[only]} if only else runs), notes


def detect_size() -> str:
    try:
        import torch
    except ImportError:
        sys.exit("gpu_check: torch is not importable by this python; run it inside the image")
    return "gpu" if torch.cuda.is_available() else "cpu"


def markdown(figures: dict) -> str:
    """The figures as a short Markdown summary: one table per run, one row per dtype."""
    lines = [f"GPU check, {figures['mode']} mode, size {figures['size']}, {figures['total_seconds']:.0f} s in all.", ""]
    columns = ["dtype", "decision", "FP32 s/step", "AMP s/step", "speedup vs FP32 (IQR)", "vs TF32 (IQR)"]
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
            sec, method = b["seconds_per_step"], b["method"]
            cells = [
                dtype,
                dec["decision"],
                f"{sec['fp32']['median']:.4g}",
                f"{sec['amp']['median']:.4g}",
                _ratio(b.get("speedup")),
                _ratio(b.get("speedup_vs_tf32")),
                _ratio(b.get("memory_ratio")),
                f"{method['repeats']} x {method['steps_per_repeat']} steps",
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
    parser.add_argument("--only", choices=("default", "transformer"), help="run one of the two runs")
    parser.add_argument(
        "--task", choices=("transformer",), help="default run on the transformer example even where scikit-learn exists"
    )
    parser.add_argument("--dtypes", help="comma-separated trial.dtypes override, e.g. float16")
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
        for name, override in runs.items():
            print(f"gpu_check: run {name} ({figures['mode']}, size {size})", flush=True)
            repo = make_copy(work / name, override)
            t0 = time.monotonic()
            stages = run_dvc(repo) if use_dvc else run_stages(repo)
            run_dtypes = yaml.safe_load((repo / "params.yaml").read_text())["trial"]["dtypes"]
            figures["runs"][name] = {
                "note": notes.get(name, ""),
                "params_override": override,
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
