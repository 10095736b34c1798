"""pipeline/devices.py: which autocast dtypes a device runs, and the one line that says what to use instead."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline import devices
from pipeline.config import DTYPES
from pipeline.errors import UserError
from pipeline.precision import parse_dtype


def _env(backend: str, name: str, capability: str, torch_version: str) -> devices.Environment:
    device = "cpu" if backend == "cpu" else "cuda"
    return devices.Environment(backend, device, torch_version, name, capability, threads=1, interop_threads=1, blas="mkl")


CPU = _env("cpu", "Some CPU", "AVX2", "2.13.0")
A100 = _env("cuda", "NVIDIA A100", "8.0", "2.11.0")
T4 = _env("cuda", "Tesla T4", "7.5", "2.11.0")
MAXWELL = _env("cuda", "GTX 980", "5.2", "2.4.0")


def test_dtype_problems_say_what_to_use_instead() -> None:
    assert devices.dtype_problem(A100, "bfloat16", True) is None
    assert devices.dtype_problem(CPU, "float16", True) is None
    bf16_on_t4 = devices.dtype_problem(T4, "bfloat16", True)
    assert "Tesla T4" in bf16_on_t4 and "7.5" in bf16_on_t4 and "use float16 instead" in bf16_on_t4
    assert "keep FP32" in devices.dtype_problem(MAXWELL, "float16", True)
    old_cpu = devices.dtype_problem(dataclasses.replace(CPU, torch="2.3.1"), "float16", False)
    assert "use bfloat16 instead" in old_cpu
    for message in (bf16_on_t4, old_cpu):
        assert "\n" not in message and message.startswith("trial.variants: ")


def test_cpu_runs_both_dtypes_and_records_name_and_capability() -> None:
    cpu = torch.device("cpu")
    env = devices.describe(cpu)
    assert env.backend == "cpu" and env.device_name and env.capability
    # What a manifest records: the GPU and torchrun keys are absent on one CPU process, and the record reads back.
    written = env.as_dict()
    assert set(written) == {"backend", "device", "torch", "device_name", "capability", "threads", "interop_threads", "blas"}
    assert devices.Environment.from_dict(written) == env
    for name in DTYPES:
        devices.check_dtype_supported(cpu, parse_dtype(name))  # CPU autocast takes both on torch >= 2.4
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="use device: cpu or auto"):
            devices.resolve("cuda")
