"""Inference on the fixed set: the outputs under a precision policy, chunk by chunk, and the FP64 arbiter's.

The reference, every trial and the diagnosis's searches read outputs through these functions only, so a
gap between two runs is the precision policy's and nothing else's: the same batches of rows, the same
train/eval mode, and the same random state for every pass (dropout on, or a forward that draws in eval mode).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Iterator

import torch

from pipeline import cases, precision, transforms
from pipeline.errors import UserError
from pipeline.config import Params, Policy
from pipeline.task import (FLOAT32_EXACT_WHOLE, Inputs, call, iter_rows, map_floating, named_outputs, primary, rows, rows_within,
                           to_device)

INFERENCE_SEED = 0
"""The random state every inference pass starts from, in either mode."""

BATCH_ROWS = 256
"""Rows per inference batch: every pass over the fixed set (reference, trial) batches it so; freeze's probe repeats the
first such batch (``probe.check``)."""


@contextlib.contextmanager
def inference_rng(device: torch.device, seed: int = INFERENCE_SEED) -> Iterator[None]:
    """Every inference pass (reference, trial, trained trial, FP64 arbiter, the probe's) draws from the same state,
    ``INFERENCE_SEED``, so that FP32 against FP32 is identical and a gap is precision's: dropout in train mode
    (``reference.eval_mode: false``), and in eval mode too, where a forward may draw all the same (``F.dropout(h, p,
    training=True)``, MC dropout, ``torch.randn_like`` noise). Seeded in train mode alone, such a forward drew from
    wherever the process's RNG stood: freeze's pass after training, the trial's after loading, and an FP32 trial was
    rolled back on 139 flips of its masks. The global RNG is restored afterwards, so inference never moves what
    training draws next. Randomness outside torch's generators (numpy, ``random``) is not seeded: ``probe.check``
    refuses it."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


@torch.no_grad()
def infer_chunks(
    model: torch.nn.Module,
    x: Inputs,
    policy: Policy,
    device: torch.device,
    eval_mode: bool,
    batch_size: int = BATCH_ROWS,
    seed: int = INFERENCE_SEED,
) -> Iterator[dict[str, torch.Tensor]]:
    """Outputs of ``model`` on ``x`` under ``policy``, one dict of float32 CPU tensors per batch of rows
    (exact for fp16/bf16 values). ``seed``: what its draws start from (``inference_rng``; another only for
    ``probe.check`` to see whether the forward draws)."""
    precision.strict_fp32()
    model.to(device)
    model.train(not eval_mode)
    runnable = transforms.apply(model, policy, device).model  # float8 layers in place, the compiled wrapper; else model
    with precision.fp32_regions(model, policy, device), inference_rng(device, seed):
        for _, _, part in iter_rows(x, batch_size):
            with precision.autocast(policy, device):
                out = named_outputs(call(runnable, to_device(part, device)))
            yield {name: recorded(name, value) for name, value in out.items()}


def recorded(name: str, value: torch.Tensor) -> torch.Tensor:
    """Output ``name`` as it is recorded: float32 on the CPU (exact for float16 and bfloat16 values, and for integers
    below 2**24).

    Raises:
        UserError: an integer output beyond 2**24 (an item id of 1.2e8), where float32 cannot tell n from n + 1, so that
            no tolerance would see a trial pick the next id.
    """
    value = value.detach()
    integer = not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
    if integer and value.numel() and int(value.abs().max()) >= FLOAT32_EXACT_WHOLE:
        raise UserError(
            f"output '{name}' holds integers up to {int(value.abs().max()):,}, beyond 2**24 = {FLOAT32_EXACT_WHOLE:,}, "
            "which float32 (outputs are recorded in it) cannot hold exactly, so no tolerance would see a trial pick the "
            "next one; return an index below 2**24 (into your own table of ids), or the scores it is picked from"
        )
    return value.float().cpu()


def infer(
    model: torch.nn.Module,
    x: Inputs,
    policy: Policy,
    device: torch.device,
    eval_mode: bool,
    batch_size: int = BATCH_ROWS,
    seed: int = INFERENCE_SEED,
) -> dict[str, torch.Tensor]:
    """All of ``infer_chunks`` concatenated (small sets)."""
    chunks: dict[str, list[torch.Tensor]] = {}
    for out in infer_chunks(model, x, policy, device, eval_mode, batch_size, seed):
        for name, value in out.items():
            chunks.setdefault(name, []).append(value)
    return {name: torch.cat(parts) for name, parts in chunks.items()}


FP64_AUTO_ELEMENTS = 16_000_000
"""``reference.fp64_arbiter: null`` (auto): the arbiter covers every case while their float64 outputs hold at most
this many elements (128 MB, a float64 forward of seconds for the examples), else the fixed set's first cases up to
it: an LLM's full float64 forward would cost another training's time and 8 bytes per logit."""

FP64_AUTO_MODEL_BYTES = 8 * 2**30
"""Auto also runs no arbiter for a model whose float64 copy would exceed this (8 GiB: a 1e9-parameter model).
Ask for cases explicitly (``reference.fp64_arbiter: N``) to run it anyway."""

FP64_CHUNK_ELEMENTS = 4_000_000
"""The most float64 output elements one arbiter batch holds (32 MB): a batch of LM cases stays this size."""

FP64_DEVICE_HEADROOM = 3
"""The arbiter runs on the model's GPU when that GPU has this many times the float64 copy's bytes free (the copy,
and room for its activations), else on the CPU: a GPU-sized model's float64 forward is work for a GPU, not for one
CPU thread (the 57M-parameter transformer example: about 7.7 TFLOP over its 264 cases of 256 tokens)."""


@dataclass(frozen=True)
class Fp64Outputs:
    """The FP64 arbiter's outputs on the fixed set's first ``cases`` rows, chunk by chunk."""

    cases: int
    chunks: Iterator[dict[str, torch.Tensor]]


def fp64_device(model: torch.nn.Module, device: torch.device) -> torch.device:
    """Where the FP64 arbiter runs: ``device`` when it is a GPU with room for the float64 copy
    (``FP64_DEVICE_HEADROOM``), else the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    copy_bytes = 8 * sum(t.numel() for t in (*model.parameters(), *model.buffers()) if t.is_floating_point())
    free, _ = torch.cuda.mem_get_info(device)
    return device if free >= FP64_DEVICE_HEADROOM * copy_bytes else torch.device("cpu")


def fp64_chunks(
    model: torch.nn.Module, x: Inputs, eval_mode: bool, cases: int | None = None, batch_size: int = 256,
    device: torch.device = torch.device("cpu"),
) -> Fp64Outputs | None:
    """The FP64 arbiter's outputs, float64 CPU tensors (floating inputs in float64, ids as they are), for the first
    ``cases`` rows of ``x`` (``reference.fp64_arbiter``; None: auto, see ``FP64_AUTO_ELEMENTS``), in batches of at
    most ``FP64_CHUNK_ELEMENTS`` output elements, computed on ``fp64_device(model, device)``; None when ``cases`` is 0,
    the model does not run in float64, or (auto) its float64 copy would exceed ``FP64_AUTO_MODEL_BYTES``."""
    if cases == 0 or (cases is None and 8 * sum(p.numel() for p in model.parameters()) > FP64_AUTO_MODEL_BYTES):
        return None
    where = fp64_device(model, device)

    def run(arbiter: torch.nn.Module, part) -> dict[str, torch.Tensor]:
        return named_outputs(call(arbiter, to_device(map_floating(part, torch.Tensor.double), where)))

    try:
        arbiter = copy.deepcopy(model).to(where).double()
        arbiter.train(not eval_mode)
        with torch.no_grad(), inference_rng(where):
            first_part = next(iter(iter_rows(x, 2)), None)  # two rows: a training-mode BatchNorm needs more than one
            if first_part is None:
                return None
            probe = run(arbiter, first_part[2])  # float64 at all?
    except (RuntimeError, TypeError, NotImplementedError, UserError):
        return None
    total, per_case = rows(x), max(1, sum(v[0].numel() for v in probe.values()))
    if cases is None:
        cases = total if per_case * total <= FP64_AUTO_ELEMENTS else max(1, FP64_AUTO_ELEMENTS // per_case)
    covered = x[: min(cases, total)]
    batch_size = min(batch_size, rows_within(FP64_CHUNK_ELEMENTS, per_case))

    def chunks() -> Iterator[dict[str, torch.Tensor]]:
        with torch.no_grad(), inference_rng(where):
            for _, _, part in iter_rows(covered, batch_size):
                yield {k: v.double().cpu().contiguous() for k, v in run(arbiter, part).items()}

    return Fp64Outputs(rows(covered), chunks())


def with_boundary_cases(params: Params, prepared: cases.Cases, model: torch.nn.Module, device: torch.device) -> cases.Cases:
    """The prepared cases plus boundary cases placed by the trained reference ``model`` (classification only): freeze's
    fixed set."""
    cfg = params.reference
    if params.task.kind != "classification" or not cfg.boundary_cases:
        return prepared
    ordinary = prepared.select(torch.tensor([i for i, k in enumerate(prepared.kinds) if k == "ordinary"]))

    def score(x):
        return primary(infer(model, x, Policy(), device, cfg.eval_mode))

    return prepared + cases.boundary_cases(
        score, ordinary, cfg.boundary_cases, cfg.boundary_epsilon, prepared.y, method=cfg.boundary_method
    )
