"""pipeline/devices.py: which autocast dtypes a device runs, and the one line that says what to use instead."""

from __future__ import annotations

import pytest
import torch

from pipeline import devices
from pipeline.config import DTYPES
from pipeline.errors import UserError
from pipeline.precision import parse_dtype

CPU = {"backend": "cpu", "device": "cpu", "device_name": "Some CPU", "capability": "AVX2", "torch": "2.13.0"}
A100 = {"backend": "cuda", "device": "cuda", "device_name": "NVIDIA A100", "capability": "8.0", "torch": "2.11.0"}
T4 = {"backend": "cuda", "device": "cuda", "device_name": "Tesla T4", "capability": "7.5", "torch": "2.11.0"}
MAXWELL = {"backend": "cuda", "device": "cuda", "device_name": "GTX 980", "capability": "5.2", "torch": "2.4.0"}


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
    for name in DTYPES:
        devices.check_dtype_supported(cpu, parse_dtype(name))  # CPU autocast takes both on torch >= 2.4
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="use device: cpu or auto"):
            devices.resolve("cuda")
