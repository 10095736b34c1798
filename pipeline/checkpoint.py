"""Checkpoint I/O: one safetensors file holds a whole training state; nothing is ever unpickled.

Tensors: model weights and buffers (``model/NAME``), optimizer state (``optim/IDX/KEY``), RNG states
(``rng/cpu``, ``rng/cuda``: the current GPU). Metadata (JSON strings): the GradScaler ``state_dict`` under
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
    tensors.update(rng_state())
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
        set_rng_state(ckpt.tensors)


def rng_state() -> dict[str, torch.Tensor]:
    """The CPU generator's state (``rng/cpu``) and, where a GPU is visible, the current GPU's (``rng/cuda``).

    Taken whenever CUDA (or ROCm) is available, initialised or not: a state captured before the first GPU
    op (the reference's ``init``) must still carry the GPU stream a model's forward will draw from. One GPU
    state, the current device's (a torchrun rank's own, ``cuda:LOCAL_RANK``), so that the bytes of a
    checkpoint do not depend on how many GPUs the machine has; every rank seeds and draws the same stream.
    """
    out = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["rng/cuda"] = torch.cuda.get_rng_state().to("cpu", copy=True).contiguous()
    return out


def set_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    """Put back what ``rng_state`` took: the CPU state, and the GPU state into the current GPU, where one is
    visible. A checkpoint with no GPU state (saved on a CPU machine) leaves the GPU generator as it is."""
    torch.set_rng_state(tensors["rng/cpu"])
    state = tensors.get("rng/cuda")
    if state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state)


def environment_key(device: torch.device) -> dict[str, str]:
    """What a resumed run must share with the run that saved: backend, device name and torch version."""
    from pipeline import devices  # here, so that checkpoint I/O alone never queries a GPU

    env = devices.describe(device)
    return {"backend": env["backend"], "device_name": env["device_name"], "torch": env["torch"]}


class ResumeFile:
    """A resumable training state kept beside (not inside) a stage's outputs, since DVC deletes those
    before a stage runs. ``key`` names the run (inputs and policy): a state saved by another run is ignored.

    The environment (backend, device name, torch version: ``environment_key``) is part of the key: a state
    saved by the same run on another device or torch is refused with one line, never resumed, since the
    result would be one artifact trained on two machines. ``device`` is the run's device; without it, the
    GPU when one is visible, else the CPU.
    """

    def __init__(self, path: str | Path, key: str, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.path, self.key = Path(path), key
        self.env = environment_key(torch.device(device))

    def load(self) -> Checkpoint | None:
        """The saved state of this run, None when there is none (or it is damaged, or another run's).

        Raises:
            UserError: this run's state was saved under another backend, device or torch version.
        """
        if not self.path.is_file():
            return None
        try:
            ckpt = load(self.path)
        except UserError:
            return None  # a damaged resume state costs a restart, never a wrong result
        if ckpt.meta.get("run_key") != self.key:
            return None
        saved = ckpt.meta.get("run_env")
        if saved != self.env:
            was = ", ".join(f"{k} {v}" for k, v in (saved or {}).items()) or "an unrecorded environment"
            now = ", ".join(f"{k} {v}" for k, v in self.env.items())
            raise UserError(
                f"{self.path} holds this run's interrupted state from {was}, not {now}; resume it there, "
                f"or delete {self.path} to restart from step 0 here"
            )
        return ckpt

    def save(self, ckpt: Checkpoint) -> None:
        ckpt.meta["run_key"] = self.key
        ckpt.meta["run_env"] = self.env
        save(self.path, ckpt)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
