"""The benchmark method: statistics on hand-built numbers, device capability rules, memory probes in their
own processes, the benchmark stage on a tiny project, and scripts/gpu_check.py without dvc."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, env_for, make_project, run

from pipeline import benchmark, checkpoint, devices, precision

from pipeline.compare import numerics
from pipeline.config import BenchConfig, Params
from pipeline.precision import Policy
from pipeline.benchmark import quantile, ratio_spread, spread
from pipeline.config import load_params
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
    # The project's one quantile (numerics.quantile, nearest rank): always a measured value.
    assert quantile is numerics.quantile
    assert (quantile([1.0, 2.0, 3.0, 4.0], 0.5), quantile([1.0, 2.0, 3.0, 4.0], 0.25), quantile([1.0, 2.0, 3.0, 4.0], 0.75)) == (2.0, 1.0, 3.0)
    assert spread([7.0]) == {"median": 7.0, "q1": 7.0, "q3": 7.0, "iqr": 0.0, "rel_iqr": 0.0, "min": 7.0, "max": 7.0, "n": 1}


def test_ratios_are_taken_per_round_then_summarised() -> None:
    # Round-paired: (2/1, 4/2, 9/3) = (2, 2, 3); a ratio of medians would give 4/2 = 2 with no spread at all.
    r = ratio_spread([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])
    assert (r["median"], r["q1"], r["q3"], r["max"]) == (2.0, 2.0, 3.0, 3.0)
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
    def names(env):
        return [v.name for v in benchmark.variants("bfloat16", (), env)[0]]
    assert names(A100) == ["fp32", "tf32", "amp"]
    assert names(CPU) == names(T4) == names(MI300) == ["fp32", "amp"]
    chosen, note = benchmark.variants("float16", ("head",), T4)
    assert "7.5" in note
    assert [v.tf32 for v in chosen] == [False, False], "the FP32 baseline and AMP run with TF32 off"
    assert chosen[-1].policy.dtype == "float16" and chosen[-1].policy.fp32_modules == ("head",)


def test_variants_switch_tf32_through_the_one_switch() -> None:
    """benchmark.py has no TF32 flag of its own: precision.tf32 sets it for each variant's steps."""
    assert not hasattr(benchmark, "matmul_precision")
    seen: list[tuple] = []
    steps = {name: (lambda: seen.append(precision.tf32_state()), tf32) for name, tf32 in (("fp32", False), ("tf32", True))}
    before = precision.tf32_state()
    benchmark.interleaved(steps, warmup=0, repeats=1, steps=1, device=torch.device("cpu"))
    assert precision.tf32_state() == before
    off, on = seen
    assert len(set(off)) == 1 and len(set(on)) == 1 and off != on


def test_sizes_by_device_unless_params_set_them() -> None:
    cpu, gpu = benchmark.sizes(BenchConfig(), torch.device("cpu")), benchmark.sizes(BenchConfig(), torch.device("cuda"))
    assert (cpu.warmup, cpu.repeats, cpu.steps) == benchmark.SIZES["cpu"] and "CPU" in cpu.note
    assert (gpu.warmup, gpu.repeats, gpu.steps) == benchmark.SIZES["gpu"] and "GPU" in gpu.note
    assert gpu.repeats * gpu.steps > cpu.repeats * cpu.steps
    set_ = benchmark.sizes(BenchConfig(warmup=0, repeats=2, steps=3), torch.device("cuda"))
    assert (set_.warmup, set_.repeats, set_.steps, set_.note) == (0, 2, 3, "set in params (bench)")


def _overflowing(scale: float) -> tuple[benchmark.TrainingStep, benchmark.TrainingStep]:
    """FP32 and float16 steps of one tiny model; the float16 scaler starts at ``scale``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    state = {"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}
    cpu = torch.device("cpu")
    fp32 = benchmark.make_step(benchmark.Workload(copy.deepcopy(model), [(x, y)], Params(), cpu, {}), Policy())
    amp = benchmark.make_step(benchmark.Workload(copy.deepcopy(model), [(x, y)], Params(), cpu, state), Policy(dtype="float16"))
    return fp32, amp


def test_rounds_with_a_skipped_update_are_dropped_and_reported() -> None:
    """A forced overflow on the CPU: the scaler starts at 2**22, skips 3 updates, then settles."""
    fp32, amp = _overflowing(2.0**22)
    assert amp.scaler.get_scale() == 2.0**22, "the scaler starts from the given state, not a fresh 65536"
    rounds = benchmark.interleaved({"fp32": (fp32, False), "amp": (amp, False)}, warmup=0, repeats=6, steps=2, device=torch.device("cpu"))
    assert rounds.skipped == {"fp32": [0] * 6, "amp": [2, 1, 0, 0, 0, 0]}
    assert rounds.dropped() == [0, 1]
    kept = rounds.kept_times()
    assert kept["fp32"] == rounds.times["fp32"][2:] and kept["amp"] == rounds.times["amp"][2:]
    assert amp.updates == 12 - 3 and fp32.updates == 12
    # In the record: the ratio comes from kept rounds only, the dropped ones are listed.
    memory = {n: {"peak": [1.0] * 6, "baseline": [0.5] * 6, "skipped": s, "method": "m"} for n, s in rounds.skipped.items()}
    summary = benchmark.memory_summary(memory)
    assert summary["memory_rounds_dropped"] == {"amp": [0, 1]} and summary["memory_ratio"]["n"] == 4


def test_every_round_skipped_gives_no_speedup_and_says_why() -> None:
    fp32, amp = _overflowing(2.0**60)
    rounds = benchmark.interleaved({"fp32": (fp32, False), "amp": (amp, False)}, warmup=0, repeats=3, steps=2, device=torch.device("cpu"))
    assert rounds.dropped() == [0, 1, 2]
    size = benchmark.Sizes(0, 3, 2, "test")
    memory = {n: {"peak": [2.0] * 3, "baseline": [1.0] * 3, "skipped": [0] * 3, "method": "m"} for n in ("fp32", "amp")}
    result = benchmark.record("float16", CPU, amp.work, size, "n/a", memory, rounds, None)
    assert "speedup" not in result and "raise bench.warmup" in result["no_speedup_because"]
    assert benchmark.short_metrics(result) == {"speedup": None, "mem_ratio": 1.0}
    assert "raise bench.warmup" in benchmark.summary_line(result)


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
    rounds = benchmark.interleaved(steps, warmup=1, repeats=3, steps=2, device=torch.device("cpu"))
    assert order == ["fp32", "amp"] + ["fp32"] * 2 + ["amp"] * 2 + ["amp"] * 2 + ["fp32"] * 2 + ["fp32"] * 2 + ["amp"] * 2
    assert {k: len(v) for k, v in rounds.times.items()} == {"fp32": 3, "amp": 3}
    assert all(t > 0 for v in rounds.times.values() for t in v)
    assert rounds.dropped() == [], "plain functions count no updates: nothing is dropped"


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
    for args in (["prepare"], ["freeze"], ["trial", "--dtype", "float16"]):
        proc = stage(repo, *args)
        assert proc.returncode == 0, proc.stderr
    return repo


def decide(repo: Path, dtype: str, decision: str) -> None:
    folder = repo / "data" / "decision" / dtype
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"dtype": dtype, "decision": decision, "reasons": [], "checks": [], "rule": {}, "rule_sha256": "", "policy": {}, "env": {}}
    (folder / "decision.json").write_text(json.dumps(fields))


def test_peak_memory_in_its_own_process_is_positive(frozen: Path) -> None:
    """A GPU variant's probe, run here on the CPU: a fresh process, per-round peaks."""
    repeats = yaml.safe_load((frozen / "params.yaml").read_text())["bench"]["repeats"]
    with benchmark.MemoryProbes("params.yaml", "bfloat16", ["amp"], cwd=frozen) as probes:
        memory = probes.collect()["amp"]
    assert len(memory["peak"]) == repeats
    assert all(p > 0 and p >= b > 0 for p, b in zip(memory["peak"], memory["baseline"]))
    assert "VmHWM" in memory["method"]


def test_workload_starts_from_the_trials_final_scaler_state(frozen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(frozen)
    params = load_params("params.yaml")
    trial_ckpt = checkpoint.load(frozen / "data/trial/float16/checkpoint.safetensors")
    work = benchmark.load_workload(params, torch.device("cpu"), "float16")
    assert work.scaler_state == trial_ckpt.meta["grad_scaler"] and work.scaler_state["scale"] > 0
    step = benchmark.make_step(work, Policy(dtype="float16"))
    assert step.scaler.get_scale() == trial_ckpt.meta["grad_scaler"]["scale"]
    assert benchmark.load_workload(params, torch.device("cpu")).scaler_state == {}


def test_benchmark_stage_measures_an_accepted_variant(frozen: Path) -> None:
    decide(frozen, "float16", "accept")
    proc = stage(frozen, "benchmark", "--dtype", "float16")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((frozen / "data/benchmark/float16/benchmark.json").read_text())
    metrics = json.loads((frozen / "data/metrics/bench-float16.json").read_text())
    assert metrics == {"speedup": result["speedup"]["median"], "mem_ratio": result["memory_ratio"]["median"]}
    assert result["workload"]["initial_grad_scaler"]["scale"] > 0
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
    assert "speedup x" in proc.stdout and "CPU: a short run" in proc.stdout


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
    assert json.loads((frozen / "data/metrics/bench-bfloat16.json").read_text()) == {}


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


def test_stage_plan_without_dvc() -> None:
    """gpu_check's bare-image order: the package's STAGES, per-dtype ones once per dtype, no restore."""
    plan = gpu_check.plan({"trial": {"dtypes": ["float16", "bfloat16"]}})
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


# --- scripts/gpu_profile.py and scripts/gpu_proof.sh ---------------------------------------------------------


def test_gpu_profile_on_the_cpu_at_tiny_size(tmp_path: Path) -> None:
    """The profile a GPU session reads when AMP's speedup falls short, run here on the CPU at tiny size."""
    import gpu_profile

    assert gpu_profile.main([str(tmp_path), "--size", "tiny", "--steps", "2"]) == 0
    result = json.loads((tmp_path / "profile.json").read_text())
    assert set(result["variants"]) == {"fp32", "amp"} and result["flops_per_step"] > 0
    for v in result["variants"].values():
        assert v["seconds_per_step"] > 0 and v["top_ops"] and all(0 <= o["share"] <= 1 for o in v["top_ops"])
    assert "| amp |" in (tmp_path / "profile.md").read_text()


@pytest.mark.integration  # the whole script, end to end
def test_gpu_proof_stops_in_one_line_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: run scripts/gpu_proof.sh itself")
    env = {**quiet_env(ROOT), "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_proof.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "gpu_proof: no GPU: error: device: cuda was asked for" in proc.stdout
    assert (tmp_path / "machine.txt").is_file() and not (tmp_path / "pytest-gpu.txt").exists()
