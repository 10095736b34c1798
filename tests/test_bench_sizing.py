"""pipeline/bench/sizing.py and pipeline/bench/arms.py: how long to measure, and what against what."""

from __future__ import annotations

from pipeline.bench.sizing import SIZES, sizes
from pipeline.bench.arms import arms
from pipeline.config import Policy
from pipeline.config import BenchConfig
from pipeline.devices import Environment



def _env(backend: str, device: str, name: str, capability: str, torch: str) -> Environment:
    return Environment(backend, device, torch, name, capability, threads=1, interop_threads=1, blas="n/a")


CPU = _env("cpu", "cpu", "Some CPU", "AVX2", "2.13.0")
A100 = _env("cuda", "cuda", "NVIDIA A100", "8.0", "2.11.0")
T4 = _env("cuda", "cuda", "Tesla T4", "7.5", "2.11.0")
MI300 = _env("rocm", "cuda", "AMD Instinct MI300X", "9.4", "2.10.0")


def test_sizes_by_device_unless_params_set_them() -> None:
    cpu, gpu = sizes(BenchConfig(), "cpu"), sizes(BenchConfig(), "cuda")
    assert (cpu.warmup, cpu.repeats, cpu.steps) == SIZES["cpu"] and "CPU" in cpu.note
    assert (gpu.warmup, gpu.repeats, gpu.steps) == SIZES["gpu"] and "GPU" in gpu.note
    assert gpu.repeats * gpu.steps > cpu.repeats * cpu.steps
    set_ = sizes(BenchConfig(warmup=0, repeats=2, steps=3), "cuda")
    assert (set_.warmup, set_.repeats, set_.steps, set_.note) == (0, 2, 3, "set in params (bench)")
    partly = sizes(BenchConfig(repeats=7), "cpu")
    assert (partly.warmup, partly.repeats, partly.steps) == (SIZES["cpu"][0], 7, SIZES["cpu"][2]) and "CPU" in partly.note


def test_tf32_baseline_only_where_the_gpu_has_tf32() -> None:
    def names(env):
        return [v.name for v in arms(Policy(dtype="bfloat16"), env)[0]]

    assert names(A100) == ["fp32", "tf32", "amp"]
    assert names(CPU) == names(T4) == names(MI300) == ["fp32", "amp"]
    chosen, note = arms(Policy(dtype="float16", fp32_modules=("head",)), T4)
    assert "7.5" in note
    assert [v.tf32 for v in chosen] == [False, False], "the FP32 baseline and AMP run with TF32 off"
    assert chosen[-1].policy.dtype == "float16" and chosen[-1].policy.fp32_modules == ("head",)
    assert not chosen[0].policy.amp
