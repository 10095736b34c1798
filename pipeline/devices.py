"""Which device runs, and which backend really ran it (CPU, CUDA or ROCm: both GPUs are ``cuda``)."""

from __future__ import annotations

import platform

import torch

from pipeline.errors import UserError


def resolve(choice: str) -> torch.device:
    """Map params ``device`` (auto|cpu|cuda) to a torch device.

    Raises:
        UserError: ``cuda`` was asked for and no GPU is visible.
    """
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if choice == "cuda":
        raise UserError("device: cuda was asked for but no CUDA or ROCm GPU is visible; use device: cpu or auto")
    return torch.device("cpu")


def backend(device: torch.device) -> str:
    """``cpu``, ``cuda`` or ``rocm``; on ROCm, torch still names the device ``cuda``."""
    if device.type != "cuda":
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def describe(device: torch.device) -> dict[str, str]:
    """Environment facts recorded with every output (deterministic on one machine)."""
    info = {
        "backend": backend(device),
        "device": device.type,
        "torch": torch.__version__,
        "device_name": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = props.name
        info["capability"] = f"{props.major}.{props.minor}"
        info["runtime"] = str(torch.version.hip or torch.version.cuda)
    return info


def check_dtype_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a dtype the device cannot run under autocast, saying what to use instead.

    Raises:
        UserError: bfloat16 on a GPU without bf16 support.
    """
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError(
            "trial.dtypes: bfloat16 is not supported on this GPU "
            f"({torch.cuda.get_device_name(device)}); use float16 instead"
        )
