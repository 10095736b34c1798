"""Checkpoint I/O: one safetensors file holds a whole training state; nothing is ever unpickled.

Tensors: model weights and buffers (``model/NAME``), optimizer state (``optim/IDX/KEY``), RNG states
(``rng/cpu``, ``rng/cuda/I``). Metadata (JSON strings): the GradScaler ``state_dict`` under
``grad_scaler``, optimizer param_groups and scalar state, scheduler state, step and real-update
counters, the precision policy, the training record so far, and the format version. Loading checks
the expected sha256 before opening the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pipeline.artifacts import read_tensors, write_tensors
from pipeline.errors import UserError

FORMAT_VERSION = "1"


@dataclass
class Checkpoint:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k[len("model/"):]: v for k, v in self.tensors.items() if k.startswith("model/")}


def capture(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any = None,
    meta: dict[str, Any] | None = None,
) -> Checkpoint:
    """Snapshot a training state (copies, so training can go on)."""
    tensors = {f"model/{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    out_meta: dict[str, Any] = dict(meta or {})
    if optimizer is not None:
        state = optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, entries in state["state"].items():
            for key, value in entries.items():
                if torch.is_tensor(value):
                    tensors[f"optim/{idx}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
                else:
                    scalars.setdefault(str(idx), {})[key] = value
        out_meta["optim_param_groups"] = state["param_groups"]
        out_meta["optim_scalars"] = scalars
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
    out_meta["grad_scaler"] = scaler.state_dict() if scaler is not None else {}
    out_meta["scheduler"] = scheduler.state_dict() if scheduler is not None else {}
    return Checkpoint(tensors=tensors, meta=out_meta)


def save(path: str | Path, ckpt: Checkpoint) -> str:
    """Write atomically; return the file's sha256."""
    return write_tensors(path, ckpt.tensors, {**ckpt.meta, "format_version": FORMAT_VERSION})


def load(path: str | Path, expected_sha256: str | None = None) -> Checkpoint:
    """Read a checkpoint, verifying its hash first when one is expected.

    Raises:
        UserError: missing file, hash mismatch, or not a safetensors checkpoint of this format.
    """
    tensors, meta = read_tensors(path, expected_sha256)
    version = meta.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise UserError(
            f"{path} has checkpoint format {version!r}, expected {FORMAT_VERSION!r}; "
            f"rebuild it with this version of the pipeline (`dvc repro --force`)"
        )
    return Checkpoint(tensors=tensors, meta=meta)


def restore(
    ckpt: Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any = None,
    rng: bool = True,
) -> None:
    """Put a captured state back into live objects."""
    try:
        model.load_state_dict(ckpt.model_state(), strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise UserError(f"checkpoint does not fit this model ({first}); rebuild it with `dvc repro --force`") from None
    if optimizer is not None:
        state: dict[int, dict[str, Any]] = {}
        for key, value in ckpt.tensors.items():
            if key.startswith("optim/"):
                _, idx, name = key.split("/", 2)
                state.setdefault(int(idx), {})[name] = value
        for idx, entries in ckpt.meta.get("optim_scalars", {}).items():
            state.setdefault(int(idx), {}).update(entries)
        optimizer.load_state_dict({"state": state, "param_groups": ckpt.meta["optim_param_groups"]})
    if scaler is not None and ckpt.meta.get("grad_scaler"):
        scaler.load_state_dict(ckpt.meta["grad_scaler"])
    if scheduler is not None and ckpt.meta.get("scheduler"):
        scheduler.load_state_dict(ckpt.meta["scheduler"])
    if rng:
        torch.set_rng_state(ckpt.tensors["rng/cpu"])
        cuda_keys = sorted((k for k in ckpt.tensors if k.startswith("rng/cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
        cuda_states = [ckpt.tensors[k] for k in cuda_keys]
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states)


class ResumeFile:
    """A resumable training state kept beside (not inside) a stage's outputs, since DVC deletes those
    before a stage runs. ``key`` names the run (inputs and policy): a state saved by another run is ignored.
    """

    def __init__(self, path: str | Path, key: str) -> None:
        self.path, self.key = Path(path), key

    def load(self) -> Checkpoint | None:
        if not self.path.is_file():
            return None
        try:
            ckpt = load(self.path)
        except UserError:
            return None  # a damaged resume state costs a restart, never a wrong result
        return ckpt if ckpt.meta.get("run_key") == self.key else None

    def save(self, ckpt: Checkpoint) -> None:
        ckpt.meta["run_key"] = self.key
        save(self.path, ckpt)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
