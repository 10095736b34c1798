"""Which device runs, which backend really ran it, and which autocast dtypes it can run.

Backends are ``cpu``, ``cuda`` and ``rocm``. On ROCm, torch still names the device ``cuda``: what tells the
two apart is ``torch.version.hip`` (set on ROCm builds) against ``torch.version.cuda``.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import distributed
from pipeline.artifacts.record import Record
from pipeline.errors import UserError

# Below these NVIDIA compute capabilities the hardware lacks the arithmetic: bfloat16 arrived with Ampere
# (8.0); float16 arithmetic with 5.3. torch can emulate bf16 on older cards, far slower than FP32, which is
# no configuration to validate and then ship.
_MIN_CAPABILITY = {"float16": (5, 3), "bfloat16": (8, 0)}
# TF32 tensor cores arrived with Ampere too.
TF32_MIN_CAPABILITY = (8, 0)


def resolve(choice: str) -> torch.device:
    """Map params ``device`` (auto|cpu|cuda) to a torch device.

    Raises:
        UserError: ``cuda`` was asked for and no GPU is visible.
    """
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    problem = device_node_problem(getattr(torch.version, "hip", None), Path("/dev/kfd"), os.getuid(), os.getgroups())
    if choice == "cuda":
        raise UserError(problem or "device: cuda was asked for but no CUDA or ROCm GPU is visible; use device: cpu or auto")
    if problem:  # auto: the CPU is a fallback, but not a silent one when a GPU is there and out of reach
        print(f"warning: {problem}; running on the CPU", file=sys.stderr)
    return torch.device("cpu")


def device_node_problem(hip: str | None, kfd: Path, uid: int, groups: list[int]) -> str | None:
    """Why a ROCm torch sees no GPU although the machine has one: /dev/kfd exists but this user cannot open it.

    On current ROCm hosts /dev/kfd and /dev/dri/renderD* belong to the group ``render``, whose id differs from
    host to host; a container started without that id gets no GPU, and HIP says nothing more.
    """
    if not hip or uid == 0:
        return None
    try:
        st = kfd.stat()
    except OSError:
        return None  # no AMD GPU driver here at all: nothing to say beyond "no GPU"
    if st.st_mode & 0o006 == 0o006 or (st.st_gid in groups and st.st_mode & 0o060 == 0o060):
        return None
    return (
        f"{kfd} exists but this user (uid {uid}) is not in its group (gid {st.st_gid}), so HIP sees no GPU; "
        f"add that group: docker run --group-add {st.st_gid} (on the host: getent group render | cut -d: -f3)"
    )


def backend(device: torch.device) -> str:
    """``cpu``, ``cuda`` or ``rocm``; on ROCm, torch still names the device ``cuda``."""
    if device.type != "cuda":
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


@dataclass(frozen=True)
class Environment(Record):
    """Environment facts recorded with every output (the manifests' ``env``), deterministic on one machine.

    CPU float sums are split by thread and blocked by the BLAS, so two machines' CPU bytes can only be
    compared when ``threads``, ``interop_threads`` and ``blas`` match.
    """

    ABSENT = ("runtime", "arch", "world_size", "process_group_backend", "distributed_strategy", "fsdp_blocks")

    backend: str
    """``cpu``, ``cuda`` or ``rocm`` (``backend``)."""
    device: str
    """torch's device type: ``cuda`` on ROCm too."""
    torch: str
    device_name: str
    capability: str
    """The compute capability on NVIDIA (``8.0``), the one ROCm reports beside ``arch``, and on the CPU the
    vector instruction set torch dispatches to (``AVX512``)."""
    threads: int
    """torch's intra-op thread count."""
    interop_threads: int
    blas: str
    """The CPU BLAS torch was built with (``cpu_blas``)."""
    runtime: str | None = None
    """GPUs: the CUDA or HIP version torch was built with."""
    arch: str | None = None
    """ROCm: the gfx architecture."""
    world_size: int | None = None
    """Under torchrun only (``distributed.World.describe``), with ``process_group_backend``."""
    process_group_backend: str | None = None
    distributed_strategy: str | None = None
    """``fsdp`` where FSDP2 trained (``distributed.strategy``); absent under DDP or in one process."""
    fsdp_blocks: tuple[str, ...] | None = None
    """FSDP2's block classes (``distributed.fsdp_blocks``; empty: each top-level child)."""


def describe(device: torch.device) -> Environment:
    """What ``device`` and this process are (``Environment``)."""
    where = {"device_name": _cpu_name(), "capability": _cpu_capability()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        arch = getattr(props, "gcnArchName", "")
        where = {
            "device_name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "runtime": str(torch.version.hip or torch.version.cuda),
            "arch": arch if backend(device) == "rocm" and arch else None,
        }
    return Environment(
        backend=backend(device),
        device=device.type,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
        blas=cpu_blas(),
        **where,
        **distributed.current().describe(),  # world_size, process_group_backend (FSDP2's strategy): under torchrun only
    )


def cpu_blas() -> str:
    """The CPU BLAS torch was built with and its version, e.g. ``mkl 2024.2`` or ``openblas``."""
    config = torch.__config__.show()
    match = re.search(r"BLAS_INFO=([\w.-]+)", config)
    name = match.group(1) if match else "unknown"
    version = re.search(r"Math Kernel Library Version ([\d.]+)", config) if name == "mkl" else None
    return f"{name} {version.group(1)}" if version else name


def dtype_problem(env: Environment, dtype: str, autocast_runs: bool) -> str | None:
    """Why ``dtype`` cannot run under autocast on the device ``env`` describes, with what to use; None if it can.

    Pure, so that every branch is testable without the hardware: ``env`` is what ``describe`` returns and
    ``autocast_runs`` whether a matmul under autocast actually came out in ``dtype`` on that device.
    """
    other = "bfloat16" if dtype == "float16" else "float16"
    where = f"{env.device_name} ({env.backend}"
    cap = env.capability
    if env.backend == "cuda" and dtype in _MIN_CAPABILITY and _version(cap) < _MIN_CAPABILITY[dtype]:
        need = ".".join(map(str, _MIN_CAPABILITY[dtype]))
        other_ok = _version(cap) >= _MIN_CAPABILITY[other]
        fix = (
            f"use {other} instead (a trial.policies entry with dtype: {other})"
            if other_ok
            else f"keep FP32 (no {dtype} variant in trial.variants): this GPU runs neither AMP dtype natively"
        )
        return f"trial.variants: {dtype} cannot run natively on {where}, capability {cap}; it needs {need} or newer): {fix}"
    if not autocast_runs:
        if env.backend == "cpu":
            fix = f"use {other} instead (a variant of dtype {other}), or torch >= 2.4 where CPU autocast takes both"
        else:
            fix = f"use {other} instead (a trial.policies entry with dtype: {other})"
        return f"trial.variants: torch {env.torch} cannot autocast to {dtype} on {where}): {fix}"
    return None


def check_dtype_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a dtype the device cannot run under autocast, saying what to use instead.

    Raises:
        UserError: the device lacks the dtype (bfloat16 before Ampere, float16 on CPU autocast of old torch).
    """
    name = str(dtype).removeprefix("torch.")
    problem = dtype_problem(describe(device), name, _autocast_runs(device, dtype))
    if problem:
        raise UserError(problem)


def tf32_available(env: Environment) -> tuple[bool, str]:
    """Whether a TF32 baseline can be measured on this device, and why not when it cannot."""
    if env.backend == "cpu":
        return False, "TF32 is a GPU tensor-core format; the CPU has none"
    if env.backend == "rocm":
        return False, "not measured on ROCm: whether TF32 applies depends on the GPU, the torch build and HIPBLASLT flags"
    if _version(env.capability) < TF32_MIN_CAPABILITY:
        return False, f"capability {env.capability} has no TF32 (needs 8.0 or newer)"
    return True, "capability 8.0 or newer: TF32 tensor cores"


def _autocast_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Run one small matmul under autocast and check it came out in ``dtype``.

    An unsupported combination either raises (CUDA bf16 before Ampere on some torch versions) or warns and
    disables autocast (float16 on the CPU before torch 2.4); both mean "cannot run".
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = torch.ones(8, 8, device=device)
            with torch.autocast(device_type=device.type, dtype=dtype):
                out = a @ a
        return out.dtype == dtype
    except RuntimeError:
        return False


def _version(capability: str) -> tuple[int, int]:
    try:
        major, minor = capability.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def _cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except AttributeError:  # torch builds without the query
        return "unknown"


_MISSING_KERNEL = re.compile(
    r"not implemented for '(Half|BFloat16|Float8\w*)'|could not create a primitive descriptor|Low precision dtypes not supported"
    r"|Unsupported dtype (Half|BFloat16)|no kernel (image )?is available"
)
"""How torch says an op has no kernel for a dtype on this device: a missing dispatch entry ("not implemented for
'Half'"), oneDNN refusing the primitive (the CPU's float16 LSTM), cuDNN or a GPU build without the kernel."""


def missing_kernel(exc: BaseException) -> bool:
    """``exc`` says that an op has no kernel for its dtype on this device, rather than that it raised in one (an overflow):
    the failed trial says which (``pipeline.artifacts.trial.Failure``)."""
    return isinstance(exc, NotImplementedError) or bool(_MISSING_KERNEL.search(str(exc)))


def _main(argv: list[str]) -> int:
    """``python -m pipeline.devices [auto|cpu|cuda]``: resolve the device and print what describes it, as JSON;
    one line and exit status 2 when it cannot (the GPU CI's first check that the GPU is reachable)."""
    import json

    try:
        device = resolve(argv[0] if argv else "auto")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(describe(device).as_dict(), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
