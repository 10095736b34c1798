"""The benchmark method: statistics on hand-built numbers, device capability rules, memory probes in their
own processes, the benchmark stage on a tiny project, and scripts/gpu_check.py without dvc."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, env_for, make_project, run

from pipeline import benchmark, devices
from pipeline.benchmark import quantile, ratio_spread, spread
from pipeline.errors import UserError

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check

CPU = {"backend": "cpu", "device": "cpu", "device_name": "Some CPU", "capability": "AVX2", "torch": "2.13.0"}
A100 = {"backend": "cuda", "device": "cuda", "device_name": "NVIDIA A100", "capability": "8.0", "torch": "2.11.0"}
T4 = {"backend": "cuda", "device": "cuda", "device_name": "Tesla T4", "capability": "7.5", "torch": "2.11.0"}
MAXWELL = {"backend": "cuda", "device": "cuda", "device_name": "GTX 980", "capability": "5.2", "torch": "2.4.0"}
MI300 = {"backend": "rocm", "device": "cuda", "device_name": "AMD Instinct MI300X", "capability": "9.4", "torch": "2.10.0"}


# --- statistics --------------------------------------------------------------------------------------------


def test_quantiles_median_and_iqr_on_hand_built_numbers() -> None:
    s = spread([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s["median"], s["q1"], s["q3"], s["iqr"], s["min"], s["max"], s["n"]) == (3.0, 2.0, 4.0, 2.0, 1.0, 5.0, 5)
    assert s["rel_iqr"] == pytest.approx(2 / 3)
    assert (quantile([1.0, 2.0, 3.0, 4.0], 0.5), quantile([1.0, 2.0, 3.0, 4.0], 0.25), quantile([1.0, 2.0, 3.0, 4.0], 0.75)) == (
        2.5,
        1.75,
        3.25,
    )
    assert spread([7.0]) == {"median": 7.0, "q1": 7.0, "q3": 7.0, "iqr": 0.0, "rel_iqr": 0.0, "min": 7.0, "max": 7.0, "n": 1}


def test_ratios_are_taken_per_round_then_summarised() -> None:
    # Round-paired: (2/1, 4/2, 9/3) = (2, 2, 3); a ratio of medians would give 4/2 = 2 with no spread at all.
    r = ratio_spread([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])
    assert (r["median"], r["q1"], r["q3"], r["max"]) == (2.0, 2.0, 2.5, 3.0)
    with pytest.raises(ValueError):
        ratio_spread([1.0, 2.0], [1.0])


def test_memory_summary_peak_working_and_ratios() -> None:
    fp32 = {"peak": [1000.0, 1010.0, 1000.0], "baseline": [600.0, 610.0, 600.0], "method": "m"}
    amp = {"peak": [800.0, 800.0, 810.0], "baseline": [600.0, 600.0, 610.0], "method": "m"}
    m = benchmark.memory_summary({"fp32": fp32, "amp": amp})
    assert m["peak_memory_bytes"]["fp32"]["median"] == 1000.0
    assert m["working_memory_bytes"]["fp32"]["median"] == 400.0 and m["working_memory_bytes"]["amp"]["median"] == 200.0
    assert m["memory_ratio"]["median"] == pytest.approx(0.8)
    assert m["working_memory_ratio"]["median"] == pytest.approx(0.5)


# --- variants and device capability ------------------------------------------------------------------------


def test_tf32_baseline_only_where_the_gpu_has_tf32() -> None:
    names = lambda env: [v.name for v in benchmark.variants("bfloat16", (), env)[0]]
    assert names(A100) == ["fp32", "tf32", "amp"]
    assert names(CPU) == names(T4) == names(MI300) == ["fp32", "amp"]
    chosen, note = benchmark.variants("float16", ("head",), T4)
    assert "7.5" in note
    assert [v.tf32 for v in chosen] == [False, False], "the FP32 baseline and AMP run with TF32 off"
    assert chosen[-1].policy.dtype == "float16" and chosen[-1].policy.fp32_modules == ("head",)


def test_matmul_precision_sets_and_restores_the_tf32_flags() -> None:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with benchmark.matmul_precision(True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with benchmark.matmul_precision(False):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_dtype_problems_say_what_to_use_instead() -> None:
    assert devices.dtype_problem(A100, "bfloat16", True) is None
    assert devices.dtype_problem(CPU, "float16", True) is None
    bf16_on_t4 = devices.dtype_problem(T4, "bfloat16", True)
    assert "Tesla T4" in bf16_on_t4 and "7.5" in bf16_on_t4 and "use float16 instead" in bf16_on_t4
    assert "keep FP32" in devices.dtype_problem(MAXWELL, "float16", True)
    old_cpu = devices.dtype_problem({**CPU, "torch": "2.3.1"}, "float16", False)
    assert "use bfloat16 instead" in old_cpu
    for message in (bf16_on_t4, old_cpu):
        assert "\n" not in message and message.startswith("trial.dtypes: ")


def test_cpu_runs_both_dtypes_and_records_name_and_capability() -> None:
    cpu = torch.device("cpu")
    env = devices.describe(cpu)
    assert env["backend"] == "cpu" and env["device_name"] and env["capability"]
    for dtype in (torch.float16, torch.bfloat16):
        devices.check_dtype_supported(cpu, dtype)  # CPU autocast takes both on torch >= 2.4
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="use device: cpu or auto"):
            devices.resolve("cuda")


def test_rounds_are_interleaved_with_rotating_order() -> None:
    order: list[str] = []
    steps = {name: (lambda name=name: order.append(name), False) for name in ("fp32", "amp")}
    times = benchmark.interleaved(steps, warmup=1, repeats=3, steps=2, device=torch.device("cpu"))
    assert order == ["fp32", "amp"] + ["fp32"] * 2 + ["amp"] * 2 + ["amp"] * 2 + ["fp32"] * 2 + ["fp32"] * 2 + ["amp"] * 2
    assert {k: len(v) for k, v in times.items()} == {"fp32": 3, "amp": 3}
    assert all(t > 0 for v in times.values() for t in v)


# --- on a tiny project --------------------------------------------------------------------------------------


# The sklearn-free transformer at its tiny size: same stages, less start-up per process than digits.
TINY_TRANSFORMER = {
    "task": {
        "model": "pipeline.examples.transformer:build_model",
        "data": "pipeline.examples.transformer:load_data",
        "options": gpu_check.TRANSFORMER_OPTIONS["tiny"],
    },
    "reference": gpu_check.TRANSFORMER_REFERENCE["tiny"],
}


def quiet_env(repo: Path) -> dict[str, str]:
    # One intra-op thread: these tensors are tiny, and on a shared 2-core machine a second OpenMP thread
    # waiting for a busy core makes each step many times slower. What is checked here is not speed.
    return {**env_for(repo), "OMP_NUM_THREADS": "1"}


def stage(repo: Path, *args: str):
    return run([sys.executable, "-m", "pipeline", *args], repo, check=False, env=quiet_env(repo))


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> Path:
    """A tiny project after prepare and freeze: what the benchmark reads besides the decision."""
    repo = make_project(tmp_path_factory.mktemp("bench") / "repo", TINY_TRANSFORMER)
    for name in ("prepare", "freeze"):
        proc = stage(repo, name)
        assert proc.returncode == 0, proc.stderr
    return repo


def decide(repo: Path, dtype: str, decision: str) -> None:
    folder = repo / "data" / "decision" / dtype
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "decision.json").write_text(json.dumps({"decision": decision, "reasons": []}))


def test_peak_memory_in_its_own_process_is_positive(frozen: Path) -> None:
    """One probe here (the stage test below runs both side by side): a fresh process, per-round peaks."""
    repeats = yaml.safe_load((frozen / "params.yaml").read_text())["bench"]["repeats"]
    with benchmark.MemoryProbes("params.yaml", "bfloat16", ["amp"], parallel=False, cwd=frozen) as probes:
        memory = probes.collect()["amp"]
    assert len(memory["peak"]) == repeats
    assert all(p > 0 and p >= b > 0 for p, b in zip(memory["peak"], memory["baseline"]))
    assert "VmHWM" in memory["method"]


def test_benchmark_stage_measures_an_accepted_variant(frozen: Path) -> None:
    decide(frozen, "float16", "accept")
    proc = stage(frozen, "benchmark", "--dtype", "float16")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((frozen / "data/benchmark/float16/benchmark.json").read_text())
    params = yaml.safe_load((frozen / "params.yaml").read_text())
    assert result["benchmarked"] and result["env"]["backend"] == "cpu" and result["env"]["capability"]
    assert set(result["seconds_per_step"]) == {"fp32", "amp"}, "no TF32 baseline on a CPU"
    assert "CPU has none" in result["method"]["tf32"]
    for name in ("fp32", "amp"):
        assert result["seconds_per_step"][name]["n"] == params["bench"]["repeats"]
        assert result["peak_memory_bytes"][name]["median"] > 0
        assert len(result["samples"]["memory"][name]["peak"]) == params["bench"]["repeats"]
    assert result["speedup"]["median"] > 0 and result["speedup"]["q1"] <= result["speedup"]["median"] <= result["speedup"]["q3"]
    assert result["memory_ratio"]["median"] > 0
    assert result["workload"]["batch_size"] == params["reference"]["batch_size"]
    assert result["method"]["clock"].startswith("time.perf_counter")
    assert "speedup x" in proc.stdout


def test_benchmark_stage_skips_a_rolled_back_variant(frozen: Path) -> None:
    decide(frozen, "bfloat16", "rollback")
    proc = stage(frozen, "benchmark", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((frozen / "data/benchmark/bfloat16/benchmark.json").read_text())
    assert result == {
        "benchmarked": False,
        "dtype": "bfloat16",
        "reason": "bfloat16 was rolled back; only accepted variants are benchmarked",
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_gpu_benchmark_uses_events_and_reports_tf32_where_it_exists(frozen: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(frozen, repo)
    decide(repo, "float16", "accept")
    proc = stage(repo, "benchmark", "--dtype", "float16")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((repo / "data/benchmark/float16/benchmark.json").read_text())
    assert result["method"]["clock"].startswith("CUDA events")
    assert "max_memory_allocated" in result["method"]["memory"]
    assert ("tf32" in result["seconds_per_step"]) == devices.tf32_available(result["env"])[0]


# --- scripts/gpu_check.py -----------------------------------------------------------------------------------


def test_dvc_yaml_plan_without_dvc() -> None:
    params = {**yaml.safe_load((ROOT / "params.yaml").read_text()), "trial": {"dtypes": ["float16", "bfloat16"]}}
    plan = gpu_check.plan(yaml.safe_load((ROOT / "dvc.yaml").read_text()), params)
    names = [s.name for s in plan]
    assert names[:2] == ["prepare", "freeze"] and names[-1] == "publish"
    for dtype in ("float16", "bfloat16"):
        chain = [f"trial@{dtype}", f"compare@{dtype}", f"decide@{dtype}", f"benchmark@{dtype}"]
        assert [names.index(n) for n in chain] == sorted(names.index(n) for n in chain)
    bench = plan[names.index("benchmark@bfloat16")]
    assert bench.cmd == "python -m pipeline benchmark --dtype bfloat16"
    assert "data/decision/bfloat16" in bench.deps
    assert gpu_check.interpolate("${a.b}", {"a": {"b": [1, 2]}}) == [1, 2]
    assert gpu_check.interpolate("x ${a.b} y", {"a": {"b": 3}}) == "x 3 y"


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
    assert run["params_override"]["task"]["model"] == "pipeline.examples.transformer:build_model"
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
