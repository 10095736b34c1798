"""What a variant's policy does to the model's code: torchao float8 linear layers, then ``torch.compile``.

``precision`` owns autocast, the scaler and ``fp32_modules``; this module owns the two changes that replace the
arithmetic of the model itself. ``apply`` swaps every eligible ``nn.Linear`` for torchao's ``Float8Linear``
(in place: the same Parameter objects, the same state_dict keys), then wraps the model in ``torch.compile``.

``torch.compile`` returns a wrapper whose state_dict keys gain an ``_orig_mod.`` prefix, so ``Applied`` keeps
both: ``model`` is what runs (forward and backward), ``module`` is the uncompiled model, whose state_dict,
parameters and submodule names are the eager model's. The optimizer, checkpoints and ``precision.fp32_regions``
take ``module``; a checkpoint of a compiled or float8 trial therefore has the eager model's safetensors keys.

Float8 scaling state: torchao 0.18's recipes (tensorwise, rowwise, rowwise_with_gw_hp) all scale dynamically,
from each tensor's own amax at every cast; a ``Float8Linear`` holds no buffer, and there is nothing to save
beyond the weights (tests/test_transforms.py checks the keys). torchao is an optional extra and is imported
only when a policy asks for float8.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from pipeline.bench.timing import time_steps
from pipeline.config import Policy
from pipeline.errors import UserError
from pipeline.quiet import silence_third_party_noise

FLOAT8_MULTIPLE = 16
"""torch._scaled_mm needs both dims of a float8 weight divisible by 16; emulation skips the same layers."""
FLOAT8_MIN_TORCH = (2, 11)
"""torchao 0.18 (the fp8 extra's floor) dropped its code paths for older torch; a 2.11 pre-release counts."""


@dataclass(frozen=True)
class Applied:
    """The model a variant trains and infers with, and what was done to it (``as_dict``: the trial manifest)."""

    model: torch.nn.Module = field(repr=False, compare=False)
    """What to call: the compiled wrapper, or ``module`` itself when the policy does not compile."""
    module: torch.nn.Module = field(repr=False, compare=False)
    """The uncompiled model: state_dict, parameters, named_modules (the eager model's names and objects)."""
    float8: str = "off"
    float8_kernels: Literal["real", "emulated"] | None = None
    """``real``: torch._scaled_mm on FP8 hardware; ``emulated``: the same casts in software, no speedup to quote."""
    float8_linears: tuple[str, ...] = ()
    """Qualified names of the linear layers converted to float8."""
    float8_skipped: tuple[tuple[str, str], ...] = ()
    """(name, why) for each linear layer left in high precision."""
    compiled: bool = False

    def as_dict(self) -> dict:
        """What ran; empty for a plain autocast variant, so its manifest keeps today's bytes."""
        out: dict = {}
        if self.float8 != "off":
            out.update(
                float8=self.float8,
                float8_kernels=self.float8_kernels,
                float8_linears=list(self.float8_linears),
                float8_skipped=dict(self.float8_skipped),
            )
        if self.compiled:
            out["compiled"] = True
        return out


def apply(model: torch.nn.Module, policy: Policy, device: torch.device) -> Applied:
    """The model to run under ``policy``: float8 linear layers first (changed in place), then ``torch.compile``.

    Call it after ``model.to(device)``; autocast and fp32_regions are entered around the calls as for an eager
    model (dynamo guards on both and recompiles when they change). Calling it again on the same model converts
    nothing twice (layers already float8 are kept and reported), so training and inference can each ask.

    Raises:
        UserError: float8 without torchao, float8 with no eligible linear layer, or inductor unusable here.
    """
    device = torch.device(device)
    module = model
    float8: dict = {}
    if policy.float8 != "off":
        module, float8 = _convert_float8(model, policy, device)
    if not policy.compiled:
        return Applied(model=module, module=module, **float8)
    check_inductor(device)
    _allow_recompiles()
    mode = None if policy.compile_mode == "default" else policy.compile_mode
    compiled = torch.compile(module, backend="inductor", mode=mode)
    return Applied(model=compiled, module=module, compiled=True, **float8)


# --- float8 -----------------------------------------------------------------------------------------------


def float8_kernels_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs FP8 matmuls in hardware on ``device`` (else torchao must emulate them).

    CUDA: capability 8.9 (Ada) and newer. ROCm: the GPUs torchao itself treats as FP8-capable (MI300, with
    its float8_e4m3fnuz types), which needs torchao to ask.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.version.hip:
        _float8_api()  # torchao, or the one line that says how to install it
        from torchao.utils import is_MI300

        return bool(is_MI300())
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _convert_float8(model: torch.nn.Module, policy: Policy, device: torch.device) -> tuple[torch.nn.Module, dict]:
    api = _float8_api()
    eligible, skipped = _float8_plan(model, policy.fp32_modules)
    if not eligible and not policy.fp32_modules:  # every layer kept in FP32 on purpose (a diagnosis re-run) is no mistake
        why = "; ".join(f"{name}: {reason}" for name, reason in skipped) or "the model has no nn.Linear"
        raise UserError(f"float8: {policy.float8} found no linear layer it can convert ({why}); set float8: off for this model")
    kernels = "real" if float8_kernels_available(device) else "emulated"
    config = dataclasses.replace(api.Float8LinearConfig.from_recipe_name(policy.float8), emulate=kernels == "emulated")
    modules = dict(model.named_modules())
    keep = {name for name in eligible if not isinstance(modules[name], api.float8_linear.Float8Linear)}  # once only
    converted = model
    if keep:  # a new module only when the model itself is an nn.Linear; children are swapped in place
        converted = api.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in keep)
    return converted, dict(
        float8=policy.float8, float8_kernels=kernels, float8_linears=tuple(eligible), float8_skipped=tuple(skipped)
    )


def _float8_plan(model: torch.nn.Module, fp32_modules: tuple[str, ...]) -> tuple[list[str], list[tuple[str, str]]]:
    """The linear layers torchao can convert, and (name, why) for the others."""
    # nn.MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward and never calls the layer:
    # converted, it would be listed as float8 and still run in high precision.
    unused = {f"{name}.out_proj".lstrip(".") for name, m in model.named_modules() if isinstance(m, torch.nn.MultiheadAttention)}
    eligible, skipped = [], []
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        if any(name == f or name.startswith(f + ".") for f in fp32_modules):
            skipped.append((name, "in fp32_modules"))
        elif name in unused:
            skipped.append((name, "nn.MultiheadAttention reads its weight without calling the layer"))
        elif m.in_features % FLOAT8_MULTIPLE or m.out_features % FLOAT8_MULTIPLE:
            skipped.append((name, f"{m.in_features}x{m.out_features}: float8 needs both dims divisible by {FLOAT8_MULTIPLE}"))
        else:
            eligible.append(name)
    return eligible, skipped


def float8_torch() -> bool:
    """This torch is one torchao 0.18's float8 runs on (``FLOAT8_MIN_TORCH`` or later)."""
    return tuple(map(int, re.match(r"(\d+)\.(\d+)", torch.__version__).groups())) >= FLOAT8_MIN_TORCH


def _float8_api():
    """``torchao.float8``, or the one line that says how to install it (or the torch it needs)."""
    if not float8_torch():
        need = ".".join(map(str, FLOAT8_MIN_TORCH))
        raise UserError(f"float8 needs torch >= {need} (torchao 0.18), not {torch.__version__}; upgrade torch or set float8: off")
    silence_third_party_noise()  # torchao's first import: its unloadable extensions (a stage has this already)
    try:
        import torchao.float8
    except ImportError:
        raise UserError(
            "float8 needs torchao, which is not installed: pip install 'amp-validation[fp8]', or set float8: off"
        ) from None
    return torchao.float8


# --- torch.compile ----------------------------------------------------------------------------------------


def check_inductor(device: torch.device) -> None:
    """Fail now, in one line, where inductor would fail at the first step with a long traceback.

    Raises:
        UserError: dynamo does not run on this Python; no C++ compiler (CPU); no triton (GPU).
    """
    import torch._dynamo
    import torch._inductor.config

    version = ".".join(map(str, sys.version_info[:3]))
    if not torch._dynamo.is_dynamo_supported():
        raise UserError(f"compile: inductor: torch {torch.__version__} cannot compile on Python {version}; set compile: off")
    if device.type == "cpu":
        names = [c for c in torch._inductor.config.cpp.cxx if c]
        if not any(shutil.which(c) for c in names):
            raise UserError(
                f"compile: inductor on the CPU needs a C++ compiler and {' or '.join(names)} was not found; "
                f"install one (apt-get install g++), point $CXX at one, or set compile: off"
            )
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise UserError(
                f"compile: inductor on {device} needs triton, which is not importable; install torch's triton or set compile: off"
            )


RECOMPILES = 64
"""Graphs dynamo keeps per function before it falls back to eager. A trial meets a handful (training, inference
in eval mode, the last smaller chunk, batch-of-one replays, autocast on and off in fp32_modules): at dynamo's
default of 8 the rest would run eager, silently, and the verdict would not be about the compiled model."""


def _allow_recompiles() -> None:
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # torch < 2.6: the old name
    setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILES))


def compile_seconds(step: Callable[[], None], device: torch.device, steady_steps: int = 3) -> float:
    """Seconds the first call of ``step`` spends compiling: its time minus a steady step's, measured at once.

    Give it a step that has never run (dynamo traces and inductor generates code on the first forward and
    backward, and again for each new autocast state or input shape); the ``steady_steps`` that follow are
    extra warm-up for the benchmark, not counted in its step times.
    """
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()  # compiled already in this process (the memory probe): compile again, as a fresh run does
    with torch._inductor.config.patch(fx_graph_cache=False):  # cold: inductor's on-disk cache would hide the codegen
        first = time_steps(step, 1, torch.device(device))
    steady = time_steps(step, steady_steps, torch.device(device))
    return max(first - steady, 0.0)
