"""The benchmark artifact (pipeline/artifacts/benchmark.py) and stage benchmark@DTYPE on a tiny project: the
record it writes, the memory probe's own process and the workload it reads, all on one copy of the session's
reproduced project (its prepare, freeze and float16 trial). Also scripts/gpu_check.py without dvc and scripts/gpu_proof.sh, which
run the same stages."""

from __future__ import annotations

from dataclasses import replace
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
import _project
from _project import ROOT, env_for, run
from conftest import TINY, make_project

from pipeline import checkpoint, devices
from pipeline.artifacts import benchmark
from pipeline.artifacts.comparison import UpdatesToLoss
from pipeline.bench.stats import time_to_quality
from pipeline.bench.memory import MemoryProbes
from pipeline.bench.workload import TrainingStep, load_workload
from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.config import Policy
from pipeline.files import dumps, from_jsonable


# --- the artifact ---------------------------------------------------------------------------------------------


def test_a_missing_record_reads_as_not_benchmarked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    record = benchmark.read("float16")
    assert not record.benchmarked and record.reason == "benchmark.json not found"
    assert record.metrics() == {} and "skipped (benchmark.json not found)" in record.summary_line()


def test_a_rolled_back_record_round_trips_and_a_damaged_one_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    benchmark.write(benchmark.rolled_back("bfloat16"))
    assert json.loads(Path("data/benchmark/bfloat16/benchmark.json").read_text()) == {
        "benchmarked": False, "variant": "bfloat16", "reason": "bfloat16 was rolled back; only accepted variants are benchmarked",
    }
    assert json.loads(Path("data/metrics/bench-bfloat16.json").read_text()) == {}
    assert benchmark.read("bfloat16") == benchmark.rolled_back("bfloat16")
    Path("data/benchmark/bfloat16/benchmark.json").write_text('{"benchmarked": true, "variant": "bfloat16"}')
    with pytest.raises(UserError, match="is not a benchmark record.*dvc repro -f benchmark@bfloat16"):
        benchmark.read("bfloat16")


def test_the_stage_line_and_the_report_say_the_same_speed_words() -> None:
    """``Speed.words`` (the stage's line, from the record) and ``verdict.speed_words`` (report and MLflow, from the JSON)
    are two renderers of one verdict: the same words for every verdict, bounded or not."""
    from pipeline.present import verdict

    def interval(median: float, low: float, high: float) -> benchmark.Interval:
        return benchmark.Interval(median, low, high, 0.95, 0.96 if low > float("-inf") else 1.0, 9)

    aa = interval(1.0, 0.93, 1.08)
    for speed in (
        benchmark.Speed(benchmark.FASTER, interval(1.5, 1.41, 1.62), aa, "m"),
        benchmark.Speed(benchmark.SLOWER, interval(0.32, 0.3, 0.35), aa, "m"),
        benchmark.Speed(benchmark.NO_DIFFERENCE, interval(1.03, 0.91, 1.12), aa, "m"),
        benchmark.Speed(benchmark.NO_DIFFERENCE, interval(1.25, float("-inf"), float("inf")), aa, "m"),
    ):
        raw = from_jsonable(json.loads(dumps({"speed": speed.as_dict(), "speedup": {"median": speed.speedup.median}})))
        assert verdict.speed_words(raw) == speed.words()
        assert benchmark.Speed.from_dict(raw["speed"]) == speed
    assert benchmark.Speed(benchmark.NO_DIFFERENCE, interval(1.03, 0.91, 1.12), aa, "m").words() == (
        "no measurable difference (x1.03, 95 % interval 0.91-1.12; FP32 against itself 0.93-1.08)"
    )
    # The time to FP32's final loss follows, in the same words from either side; a trial that never got there claims none.
    fast = benchmark.Speed(benchmark.FASTER, interval(2.0, 1.9, 2.1), aa, "m")
    for reach in (UpdatesToLoss(1.0, 15, 150, 150, 150, 150, (140, 150)), UpdatesToLoss(1.0, 15, 150, 120, 130, 150, ()),
                  UpdatesToLoss(1.0, 15, 150, 150, 150, 150, (None, 120)), UpdatesToLoss(1.0, 15, 150, None, None, 150, (140,))):
        speed = replace(fast, to_quality=time_to_quality(fast.speedup, reach))
        raw = from_jsonable(json.loads(dumps({"speed": speed.as_dict(), "speedup": {"median": speed.speedup.median}})))
        assert verdict.speed_words(raw) == speed.words() and benchmark.Speed.from_dict(raw["speed"]) == speed
        assert speed.words().startswith("x2.00 faster (95 % interval 1.90-2.10; FP32 against itself 0.93-1.08); ")
    assert speed.words().endswith("; never reached FP32's final loss in 150 updates (FP32 150; FP32's replicates 140): "
                                  "no time-to-quality claim")
    first = replace(fast, to_quality=time_to_quality(fast.speedup, UpdatesToLoss(1.0, 15, 150, 150, 150, 150, (140, 150))))
    assert first.words().endswith(
        "; time to FP32's final loss: x0.50 (0.48-0.56; AMP needed 150 of 150 updates, FP32 150; FP32's replicates 140-150)"
    )


def test_the_artifact_is_torch_free() -> None:
    code = "import sys, pipeline.artifacts.benchmark; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- on a tiny project --------------------------------------------------------------------------------------


def quiet_env(repo: Path) -> dict[str, str]:
    # One intra-op thread: these tensors are tiny, and on a shared 2-core machine a second OpenMP thread
    # waiting for a busy core makes each step many times slower. What is checked here is not speed.
    return {**env_for(repo), "OMP_NUM_THREADS": "1"}


def stage(repo: Path, *args: str):
    return run([sys.executable, "-m", "pipeline", *args], repo, check=False, env=quiet_env(repo))


@pytest.fixture(scope="module")
def frozen(reproduced, tmp_path_factory) -> Path:
    """A copy of the session's tiny project after `dvc repro` (prepare, freeze, the float16 trial: what the benchmark
    reads besides the decision, which each test writes)."""
    repo = tmp_path_factory.mktemp("bench") / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    return repo


def decide(repo: Path, dtype: str, decision: str) -> None:
    folder = repo / "data" / "decision" / dtype
    folder.mkdir(parents=True, exist_ok=True)
    fields = {
        "variant": dtype, "decision": decision, "reasons": [], "checks": [], "rule": {}, "rule_sha256": "", "policy": {},
        "env": {},
    }
    (folder / "decision.json").write_text(json.dumps(fields))


def test_peak_memory_in_its_own_process_is_positive(frozen: Path) -> None:
    """A GPU variant's probe, run here on the CPU: a fresh process, per-round peaks."""
    repeats = yaml.safe_load((frozen / "params.yaml").read_text())["bench"]["repeats"]
    with MemoryProbes("params.yaml", "bfloat16", ["amp"], cwd=frozen) as probes:
        memory = probes.collect()["amp"]
    assert len(memory.peak) == repeats and memory.skipped == (0,) * repeats
    assert all(p > 0 and p >= b > 0 for p, b in zip(memory.peak, memory.baseline))
    assert "VmHWM" in memory.method


def test_workload_starts_from_the_trials_final_scaler_state(frozen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(frozen)
    params = load_params("params.yaml")
    trial_ckpt = checkpoint.load(frozen / "data/trial/float16/checkpoint.safetensors")
    work = load_workload(params, torch.device("cpu"), "float16")
    assert work.scaler_state == trial_ckpt.meta["grad_scaler"] and work.scaler_state["scale"] > 0
    step = TrainingStep(work, Policy(dtype="float16"))
    assert step.scaler.get_scale() == trial_ckpt.meta["grad_scaler"]["scale"]
    assert load_workload(params, torch.device("cpu")).scaler_state == {}


def test_benchmark_stage_measures_an_accepted_variant(frozen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decide(frozen, "float16", "accept")
    proc = stage(frozen, "benchmark", "--variant", "float16")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((frozen / "data/benchmark/float16/benchmark.json").read_text())
    metrics = json.loads((frozen / "data/metrics/bench-float16.json").read_text())
    assert metrics == {"speedup": result["speedup"]["median"], "mem_ratio": result["memory_ratio"]["median"]}
    assert result["workload"]["initial_grad_scaler"]["scale"] > 0
    params = yaml.safe_load((frozen / "params.yaml").read_text())
    assert result["benchmarked"] and result["env"]["backend"] == "cpu" and result["env"]["capability"]
    assert set(result["seconds_per_step"]) == {"fp32", "amp", "fp32_again"}, "no TF32 baseline on a CPU"
    assert "CPU has none" in result["method"]["tf32"]
    for name in ("fp32", "amp"):
        assert result["seconds_per_step"][name]["n"] == params["bench"]["repeats"]
        assert result["peak_memory_bytes"][name]["median"] > 0
        assert len(result["samples"]["memory"][name]["peak"]) == params["bench"]["repeats"]
    assert result["speedup"]["median"] > 0 and result["speedup"]["q1"] <= result["speedup"]["median"] <= result["speedup"]["q3"]
    assert result["memory_ratio"]["median"] > 0
    assert result["workload"]["batch_size"] == params["reference"]["batch_size"]
    assert result["method"]["clock"].startswith("time.perf_counter")
    # FP32 timed again in the same rounds (the A/A), its memory not probed; the verdict judges against it.
    assert len(result["samples"]["seconds_per_step"]["fp32_again"]) == params["bench"]["repeats"]
    assert "fp32_again" not in result["samples"]["memory"]
    speed = result["speed"]
    assert speed["speedup"]["median"] == result["speedup"]["median"] and speed["fp32_again"]["n"] == speed["speedup"]["n"]
    if params["bench"]["repeats"] < 6:  # too few rounds for a 95 % interval: never called faster or slower
        assert speed["speedup"]["high"] == "inf" and speed["verdict"] == "no measurable difference"
    assert "speedup x" not in proc.stdout and "CPU: a short run" in proc.stdout
    assert ("no measurable difference (x" in proc.stdout) == (speed["verdict"] == "no measurable difference")
    # The time to FP32's final loss: compare's updates to it, times the step times just measured.
    reach = json.loads((frozen / "data/compare/float16/stats.json").read_text())["training"]["updates_to_fp32_loss"]
    q = from_jsonable(speed["to_quality"])
    assert {k: q[k] for k in ("target", "amp", "of", "fp32", "fp32_replicates")} == {
        k: reach[k] for k in ("target", "amp", "of", "fp32", "fp32_replicates")}
    assert reach["fp32"] <= reach["of"] and len(reach["fp32_replicates"]) == params["reference"].get("replicates", 2)
    if reach["amp"] is None:
        assert q["verdict"] == "never reached" and "never reached FP32's final loss in" in proc.stdout
    else:
        assert q["ratio"] == pytest.approx(reach["amp_steps"] / reach["fp32"] / speed["speedup"]["median"])
        assert q["low"] <= q["ratio"] <= q["high"] and "; time to FP32's final loss: x" in proc.stdout
        if params["bench"]["repeats"] < 6:
            assert (q["low"], q["high"], q["verdict"]) == (0.0, math.inf, "no measurable difference")
    monkeypatch.chdir(frozen)
    record = benchmark.read("float16")
    assert record.benchmarked and record.metrics() == metrics and record.summary_line() in proc.stdout


def test_benchmark_stage_skips_a_rolled_back_variant(frozen: Path) -> None:
    decide(frozen, "bfloat16", "rollback")
    proc = stage(frozen, "benchmark", "--variant", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((frozen / "data/benchmark/bfloat16/benchmark.json").read_text())
    assert result == {
        "benchmarked": False,
        "variant": "bfloat16",
        "reason": "bfloat16 was rolled back; only accepted variants are benchmarked",
    }
    assert json.loads((frozen / "data/metrics/bench-bfloat16.json").read_text()) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_gpu_benchmark_uses_events_and_reports_tf32_where_it_exists(tmp_path: Path) -> None:
    """prepare, freeze and the float16 trial run on the GPU by the stages themselves (no dvc, git or MLflow: a bare
    PyTorch image runs this too), then the benchmark of the accepted variant."""
    repo = _project.copy(tmp_path / "repo", override=_project.merge(TINY, {"device": "cuda", "trial": {"variants": ["float16"]}}))
    for step in _project.plan(_project.params(repo), repo):
        if step.name in ("prepare", "freeze", "trial@float16", "compare@float16"):  # compare: the updates to quality
            run(step.argv(), repo, env=quiet_env(repo))
    decide(repo, "float16", "accept")
    proc = stage(repo, "benchmark", "--variant", "float16")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((repo / "data/benchmark/float16/benchmark.json").read_text())
    assert result["method"]["clock"].startswith("CUDA events")
    assert "max_memory_allocated" in result["method"]["memory"]
    assert ("tf32" in result["seconds_per_step"]) == devices.tf32_available(devices.Environment.from_dict(result["env"]))[0]


# --- scripts/gpu_check.py -----------------------------------------------------------------------------------


def test_stage_plan_without_dvc() -> None:
    """gpu_check's bare-image order: the package's STAGES, per-dtype ones once per dtype, no restore."""
    plan = _project.plan({"trial": {"variants": ["float16", "bfloat16"]}})
    names = [s.name for s in plan]
    assert names[:2] == ["prepare", "freeze"] and names[-1] == "publish" and "restore@float16" not in names
    for dtype in ("float16", "bfloat16"):
        chain = [f"trial@{dtype}", f"compare@{dtype}", f"decide@{dtype}", f"benchmark@{dtype}"]
        assert [names.index(n) for n in chain] == sorted(names.index(n) for n in chain)


def test_gpu_check_runs_the_stages_without_dvc_and_writes_figures(tmp_path: Path) -> None:
    """The bare-image path on the CPU: no dvc, the sklearn-free transformer example, tiny sizes."""
    repo = make_project(tmp_path / "repo")
    shutil.copytree(ROOT / "scripts", repo / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "figures"
    args = [
        sys.executable,
        "scripts/gpu_check.py",
        str(out),
        "--no-dvc",
        "--size",
        "tiny",
        "--only",
        "transformer",
        "--dtypes",
        "float16",
    ]
    proc = subprocess.run(args, cwd=repo, env=quiet_env(repo), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((out / "figures.json").read_text())
    assert figures["mode"] == "stages (no dvc)" and figures["size"] == "tiny"
    run = figures["runs"]["transformer"]
    assert run["params"]["task"]["model"] == "pipeline.examples.transformer:build_model"
    statuses = {s["stage"]: s["status"] for s in run["stages"]}
    assert list(statuses)[:3] == ["prepare", "freeze", "trial@float16"]
    assert statuses["publish"].startswith("skipped")
    assert all(s == "ok" or s.startswith("skipped") for s in statuses.values()), statuses
    assert statuses["benchmark@float16"] == "ok"
    assert run["env"]["backend"] == "cpu"
    decision = run["decisions"]["float16"]["decision"]
    bench = run["benchmark"]["float16"]
    assert bench["benchmarked"] == (decision == "accept")
    if bench["benchmarked"]:
        assert bench["speedup"]["median"] > 0 and bench["memory_ratio"]["median"] > 0
    assert "| float16 |" in (out / "figures.md").read_text()
    assert figures["total_seconds"] > 0 and figures["within_time_limit"]
    assert not (repo / "data").exists(), "gpu_check works in copies, never in the project it is given"


# --- scripts/gpu_proof.sh ---------------------------------------------------------------------------------


@pytest.mark.integration  # the whole script, end to end
def test_gpu_proof_stops_in_one_line_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: run scripts/gpu_proof.sh itself")
    env = {**quiet_env(ROOT), "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_proof.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2 and "gpu_proof: no GPU: error: device: cuda was asked for" in proc.stdout
    assert (tmp_path / "machine.txt").is_file() and not (tmp_path / "pytest-gpu.txt").exists()
