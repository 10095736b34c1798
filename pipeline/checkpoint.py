"""Checkpoint I/O: one safetensors file holds a whole training state; nothing is ever unpickled.

Tensors: model weights and buffers (``model/NAME``), optimizer state (``optim/IDX/KEY``), RNG states
(``rng/cpu``, ``rng/cuda``: the current GPU). Metadata (JSON strings): the GradScaler ``state_dict`` under
``grad_scaler``, optimizer param_groups and scalar state, scheduler state, step and real-update
counters, the precision policy, the training record so far, and the format version. Loading checks
the expected sha256 before opening the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts.record import Record
from pipeline.files import check_inside_repository, read_tensors, read_tensors_hashed, sha256_file, write_bytes, write_tensors
from pipeline.errors import UserError

FORMAT_VERSION = "1"


@dataclass(frozen=True)
class ResumeContext(Record):
    """What changes the bytes of a training run besides its inputs (``resume_context``): a resume state
    saved under another context is another run's."""

    run: str
    """The run's key: inputs, params and initial weights."""
    code: str
    """sha256 of ``code_digest``."""
    threads: int
    interop_threads: int
    world_size: int


@dataclass(frozen=True)
class RunEnv(Record):
    """Where a resumable run trains (``environment_key``): its state is resumed there only."""

    backend: str
    device_name: str
    torch: str


@dataclass(frozen=True)
class Meta(Record):
    """A checkpoint's metadata, key for key (each value a JSON string in the safetensors header).

    ``grad_scaler``, ``scheduler``, ``optim_param_groups`` and ``optim_scalars`` are torch's own state_dict
    parts as torch gives them (``{}``: no scaler, no scheduler), so they stay plain JSON. The loop's counters,
    its records (``artifacts.steps.StepRecord`` as dicts) and its policy are written by training; ``run_key``,
    ``resume_context`` and ``run_env`` by ``ResumeFile``; each is absent from a file that has none.
    """

    ABSENT = ("optim_param_groups", "optim_scalars", "step", "real_updates", "records", "policy", "run_key",
              "resume_context", "run_env")

    format_version: str
    grad_scaler: dict
    scheduler: dict
    optim_param_groups: list | None = None
    optim_scalars: dict | None = None
    step: int | None = None
    real_updates: int | None = None
    records: tuple[dict, ...] | None = None
    policy: dict | None = None
    run_key: str | None = None
    resume_context: ResumeContext | None = None
    run_env: RunEnv | None = None


@dataclass(frozen=True)
class Checkpoint:
    tensors: dict[str, torch.Tensor]
    info: Meta

    @property
    def meta(self) -> dict[str, Any]:
        """The metadata as the file holds it (``info`` key for key): what ``save`` writes."""
        return self.info.as_dict()

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k[len("model/"):]: v for k, v in self.tensors.items() if k.startswith("model/")}


def capture(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any = None,
    *,
    step: int | None = None,
    real_updates: int | None = None,
    records: Sequence[dict] | None = None,
    policy: dict | None = None,
    states: tuple[dict, dict] | None = None,
) -> Checkpoint:
    """Snapshot a training state (copies, so training can go on); the loop passes its counters, records and policy.
    ``states``: the model's and optimizer's state_dicts as gathered already (FSDP2's, ``distributed.World.full_state``),
    instead of their own ``state_dict()``."""
    weights, optim_state = states if states is not None else (model.state_dict(), None)
    tensors = {f"model/{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}
    groups = scalars = None
    if optimizer is not None:
        optim, groups, scalars = _optimizer_parts(optim_state if optim_state is not None else optimizer.state_dict())
        tensors.update(optim)
    tensors.update(rng_state())
    info = Meta(
        format_version=FORMAT_VERSION,
        grad_scaler=scaler.state_dict() if scaler is not None else {},
        scheduler=scheduler.state_dict() if scheduler is not None else {},
        optim_param_groups=groups,
        optim_scalars=scalars,
        step=step,
        real_updates=real_updates,
        records=tuple(records) if records is not None else None,
        policy=policy,
    )
    return Checkpoint(tensors=tensors, info=info)


def _optimizer_parts(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list, dict[str, dict[str, Any]]]:
    """torch's ``Optimizer.state_dict()`` split for the file: its tensors (``optim/IDX/KEY``), its param_groups,
    and its non-tensor state per parameter index (``_optimizer_state`` puts them together again)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"optim/{idx}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, state["param_groups"], scalars


def _optimizer_state(ckpt: Checkpoint) -> dict[str, Any]:
    """The ``Optimizer.state_dict()`` that ``_optimizer_parts`` split."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in ckpt.tensors.items():
        if key.startswith("optim/"):
            _, idx, name = key.split("/", 2)
            state.setdefault(int(idx), {})[name] = value
    for idx, entries in (ckpt.info.optim_scalars or {}).items():
        state.setdefault(int(idx), {}).update(entries)
    return {"state": state, "param_groups": ckpt.info.optim_param_groups}


def save(path: str | Path, ckpt: Checkpoint) -> str:
    """Write atomically; return the file's sha256."""
    return write_tensors(path, ckpt.tensors, ckpt.meta)


def load(path: str | Path, expected_sha256: str | None = None) -> Checkpoint:
    """Read a checkpoint, verifying its hash first when one is expected.

    Raises:
        UserError: missing file, hash mismatch, or not a safetensors checkpoint of this format.
    """
    tensors, meta = read_tensors(path, expected_sha256)
    info = parse_meta(meta)
    if isinstance(info, str):
        raise UserError(
            f"{path} is not a checkpoint of format {FORMAT_VERSION!r} ({info}); "
            f"rebuild it with this version of the pipeline (`dvc repro --force`)"
        )
    return Checkpoint(tensors=tensors, info=info)


def parse_meta(meta: dict[str, Any]) -> Meta | str:
    """A file's metadata as ``Meta``, or what keeps it from being one of this format (another version's keys,
    or another ``format_version``)."""
    try:
        info = Meta.from_dict(meta)
    except (ValueError, TypeError, AttributeError) as exc:
        return str(exc)
    return info if info.format_version == FORMAT_VERSION else f"format {info.format_version!r}"


def restore(
    ckpt: Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any = None,
    rng: bool = True,
    load: Any = None,
) -> None:
    """Put a captured state back into live objects. ``load(weights, optimizer_state)``: how the model's and optimizer's
    state go in when not by their own ``load_state_dict`` (FSDP2's shards: ``distributed.World.load_full_state``)."""
    try:
        if load is not None:
            load(ckpt.model_state(), _optimizer_state(ckpt) if optimizer is not None else None)
        else:
            model.load_state_dict(ckpt.model_state(), strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise UserError(f"checkpoint does not fit this model ({first}); rebuild it with `dvc repro --force`") from None
    if optimizer is not None and load is None:
        optimizer.load_state_dict(_optimizer_state(ckpt))
    if scaler is not None and ckpt.info.grad_scaler:
        scaler.load_state_dict(ckpt.info.grad_scaler)
    if scheduler is not None and ckpt.info.scheduler:
        scheduler.load_state_dict(ckpt.info.scheduler)
    if rng:
        set_rng_state(ckpt.tensors)


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of named tensors (name, dtype, shape and bytes, in name order): the initial weights' hash."""
    digest = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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


def environment_key(device: torch.device) -> RunEnv:
    """What a resumed run must share with the run that saved: backend, device name and torch version."""
    from pipeline import devices  # here, so that checkpoint I/O alone never queries a GPU

    env = devices.describe(device)
    return RunEnv(backend=env.backend, device_name=env.device_name, torch=env.torch)


SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def scaler_problem(state: Any, enabled: bool = False) -> str | None:
    """What is wrong with a saved GradScaler ``state_dict`` for a run whose scaler is ``enabled`` or not (None:
    nothing). ``{}`` is a disabled scaler's, and only a disabled scaler's: resumed into an enabled one it would
    silently restart the scale at its initial value mid-run (a result no uninterrupted run gives).

    Every key present, every value a finite number, and the values torch itself would accept: scale > 0,
    growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1, growth tracker >= 0.
    """
    if not isinstance(state, dict):
        return f"grad_scaler is {type(state).__name__}, not a dict"
    if not state:
        return "grad_scaler is empty (a disabled scaler's), but this run's GradScaler is enabled" if enabled else None
    missing = [k for k in SCALER_KEYS if k not in state]
    if missing:
        return f"grad_scaler lacks {', '.join(missing)}"
    values = [state[k] for k in SCALER_KEYS]  # torch's own dict, read here only
    for key, value in zip(SCALER_KEYS, values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"grad_scaler {key} is {value!r}, not a finite number"
    scale, growth, backoff, interval, tracker = values
    if scale <= 0:
        return f"grad_scaler scale is {scale!r}, not > 0"
    if not growth > 1 or not 0 < backoff < 1:
        return f"grad_scaler growth_factor {growth!r} / backoff_factor {backoff!r} out of range"
    if interval < 1 or tracker < 0:
        return f"grad_scaler growth_interval {interval!r} / _growth_tracker {tracker!r} out of range"
    if not enabled:
        return "grad_scaler holds an enabled scaler's state, but this run's GradScaler is disabled"
    return None


def _counters_problem(meta: Meta) -> str | None:
    """The loop's counters of a resume state, where present: a step count, one record per step, real updates
    <= steps."""
    step = meta.step
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        return f"step is {step!r}"
    records, updates = meta.records, meta.real_updates
    if records is not None and (len(records) != step or not all(isinstance(r, dict) for r in records)):
        return f"records do not match step {step}"
    if updates is not None and (isinstance(updates, bool) or not isinstance(updates, int) or not 0 <= updates <= step):
        return f"real_updates is {updates!r} after {step} steps"
    return None


def _installed_roots() -> tuple[Path, ...]:
    import site
    import sysconfig

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:  # some virtualenvs' site module
        pass
    return tuple(Path(r).resolve() for r in roots if r)


def code_digest() -> dict[str, str]:
    """sha256 of the code a training run executes, by module name: every ``.py`` file of the ``pipeline``
    package, and every module imported so far that is not part of the Python installation (the task's own
    modules: the model, the data function, a custom loss or optimizer, wherever they live). Module names,
    not paths: a copy of the project in another folder keeps its key."""
    import pipeline

    package = Path(pipeline.__file__).resolve().parent
    files = {f"pipeline/{p.relative_to(package).as_posix()}": p for p in package.rglob("*.py")}
    roots = _installed_roots()
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if not origin or not origin.endswith(".py"):
            continue
        path = Path(origin).resolve()
        if path.is_relative_to(package) or any(path.is_relative_to(r) for r in roots) or not path.is_file():
            continue
        files[name] = path
    return {name: sha256_file(path) for name, path in sorted(files.items())}


def resume_context(key: str, device: torch.device) -> ResumeContext:
    """Everything that changes the bytes of a training run besides its inputs (which ``key`` covers): the
    code (``code_digest``), torch's intra- and inter-op thread counts, the world size."""
    from pipeline import distributed

    return ResumeContext(
        run=key,
        code=hashlib.sha256(json.dumps(code_digest(), sort_keys=True).encode()).hexdigest(),
        threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
        world_size=distributed.current().size,
    )


class ResumeFile:
    """A resumable training state kept beside (not inside) a stage's outputs, since DVC deletes those
    before a stage runs. ``key`` names the run (inputs, initial weights and policy); the state is also
    keyed on the code, the thread counts and the world size (``resume_context``): a state saved by another
    run is ignored, with one line saying what differs, and the run restarts from step 0.

    Integrity: ``save`` writes the file's sha256 to a sidecar (``NAME.sha256``), and ``load`` verifies it
    before anything is read, then checks the GradScaler state and the loop's counters. A damaged state (a
    flipped bit, an edited scale, a missing sidecar, a NaN or negative scale, a missing key) is reported in
    one line and costs a restart from step 0, never a wrong result.

    The environment (backend, device name, torch version: ``environment_key``) is checked apart: a state
    saved by the same run on another device or torch is refused with one line, never resumed, since the
    result would be one artifact trained on two machines. ``device`` is the run's device; without it, the
    GPU when one is visible, else the CPU.
    """

    def __init__(self, path: str | Path, key: str, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        self.path = Path(path)
        self.sidecar = self.path.with_name(self.path.name + ".sha256")
        self.context = resume_context(key, device)
        self.key = hashlib.sha256(json.dumps(self.context.as_dict(), sort_keys=True).encode()).hexdigest()
        self.env = environment_key(device)

    def load(self, scaler: bool = False) -> Checkpoint | None:
        """The saved state of this run, None when there is none (or it is damaged, or another run's). ``scaler``:
        whether this run's GradScaler is enabled (its saved state must be an enabled scaler's, ``scaler_problem``).

        Raises:
            UserError: this run's state was saved under another backend, device or torch version.
        """
        if not self.path.is_file():
            return None
        try:
            tensors, meta, actual = read_tensors_hashed(self.path)  # parsed, never executed; not used before its hash is checked
        except UserError:
            return self._restart("is not a readable safetensors file (truncated?)")
        info = parse_meta(meta)
        if isinstance(info, str):
            return self._restart(f"has another checkpoint format than {FORMAT_VERSION!r} ({info})")
        if info.run_key != self.key:
            return self._restart(f"was saved by another run ({self._what_differs(info.resume_context)} differ)", damaged=False)
        expected = self._expected_sha256()  # before the environment: a damaged byte there is damage
        if expected is None:
            return self._restart(f"has no valid sha256 record ({self.sidecar.name} missing or unreadable)")
        if actual != expected:
            return self._restart(
                f"does not match its sha256 in {self.sidecar.name} (damaged or edited: {actual[:12]}… != {expected[:12]}…)"
            )
        saved = info.run_env
        if saved != self.env:
            was = ", ".join(f"{k} {v}" for k, v in saved.as_dict().items()) if saved else "an unrecorded environment"
            now = ", ".join(f"{k} {v}" for k, v in self.env.as_dict().items())
            raise UserError(
                f"{self.path} holds this run's interrupted state from {was}, not {now}; resume it there, "
                f"or delete {self.path} to restart from step 0 here"
            )
        problem = scaler_problem(info.grad_scaler, scaler) or _counters_problem(info)
        if problem:
            return self._restart(f"is inconsistent ({problem})")
        return Checkpoint(tensors=tensors, info=info)

    def save(self, ckpt: Checkpoint) -> None:
        """Write ``ckpt`` under this run's key, context and environment, and its sha256 to the sidecar."""
        info = replace(ckpt.info, run_key=self.key, resume_context=self.context, run_env=self.env)
        digest = save(self.path, replace(ckpt, info=info))
        write_bytes(self.sidecar, f"{digest}  {self.path.name}\n".encode())

    @contextlib.contextmanager
    def clear_on(self, *errors: type[BaseException]) -> Iterator[None]:
        """Clear the saved state when the block raises one of ``errors`` (a run whose result is refused: resuming
        it would reproduce the refusal), and re-raise; any other failure keeps it for the rerun."""
        try:
            yield
        except errors:
            self.clear()
            raise

    def clear(self) -> None:
        check_inside_repository(self.path.parent)  # never delete through a symlinked data/resume
        self.path.unlink(missing_ok=True)
        self.sidecar.unlink(missing_ok=True)

    def _expected_sha256(self) -> str | None:
        try:
            digest = self.sidecar.read_text().split()[0]
        except (OSError, UnicodeDecodeError, IndexError):
            return None
        return digest if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) else None

    def _what_differs(self, saved: ResumeContext | None) -> str:
        if saved is None:
            return "its key"
        names = {
            "run": "inputs, params or initial weights", "code": "code", "threads": "threads",
            "interop_threads": "interop threads", "world_size": "world size",
        }
        counted = ("threads", "interop_threads", "world_size")
        diff = [
            f"{names[f.name]} {getattr(saved, f.name)} -> {getattr(self.context, f.name)}" if f.name in counted else names[f.name]
            for f in fields(ResumeContext) if getattr(saved, f.name) != getattr(self.context, f.name)
        ]
        return ", ".join(diff) or "its key"

    def _restart(self, why: str, damaged: bool = True) -> None:
        """One line (rank 0), and None: the run starts from step 0 (the next save replaces the file)."""
        from pipeline import distributed

        if distributed.current().writes:
            what = f"{self.path}: resume state {why}" if damaged else f"{self.path} {why}"
            print(f"warning: {what}; ignored, training restarts from step 0", file=sys.stderr, flush=True)


# --- a user's checkpoint: where the reference, its replicates and every trial start (reference.checkpoint) ------------


def start(path: str | None, model: torch.nn.Module, dvc_file: str | Path = "dvc.yaml") -> tuple[Checkpoint, dict[str, str]]:
    """The state training starts from (freeze's ``init``), and ``{path: sha256}`` of the file it came from (``{}``).

    Without ``path``: ``model`` as built, with the RNG its training starts from (``capture``). With one: ``model`` takes
    the file's weights, and the state keeps the file's optimizer, scheduler and GradScaler state where it holds them (a
    checkpoint this module wrote; a file of weights alone holds none). A folder is a torch distributed checkpoint
    (``dcp``): its weights, and its optimizer's state where it holds one; its digest is of all its files. The RNG stays
    the seed's: the reference, its replicates and the trials draw the same stream whatever machine saved the file. Its
    counters, records and policy (a trial's checkpoint has them) are another run's and are not kept.

    Raises:
        UserError: the file is missing, neither a file nor a folder (a FIFO, a device), not listed in freeze's deps,
            not safetensors, of another checkpoint format, or does not fit ``model`` (keys, shapes), or its GradScaler
            state is not one torch would load; a folder that ``dcp.read`` or ``dcp.training_state`` refuses.
    """
    if path is None:
        return capture(model), {}
    where = f"params.yaml: reference.checkpoint {path}"
    if not Path(path).exists():
        raise UserError(f"{where} not found (paths are relative to the repository root); give the path of a safetensors "
                        f"file or of a torch distributed checkpoint's folder, or null to start from task.model as built")
    if not (Path(path).is_file() or Path(path).is_dir()):  # a FIFO or a device (/dev/stdin) would block when read
        raise UserError(f"{where} is neither a file nor a folder (a FIFO, a socket or a device); give the path of a "
                        f"safetensors file or of a torch distributed checkpoint's folder")
    _check_tracked(path, dvc_file)
    if Path(path).is_dir():
        return _from_dcp(where, path, model)
    try:
        tensors, meta, digest = read_tensors_hashed(path)
    except UserError as exc:
        raise UserError(f"{where} is not a safetensors file ({exc}); save weights with "
                        f"safetensors.torch.save_file(model.state_dict(), path)") from None
    info = None
    if "format_version" in meta:  # one this module wrote: weights under model/, optimizer under optim/
        info = parse_meta(meta)
        if isinstance(info, str):
            raise UserError(f"{where} is a checkpoint of another format ({info}); give one of format {FORMAT_VERSION!r} "
                            f"or the weights alone (safetensors.torch.save_file(model.state_dict(), path))")
        weights = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    else:
        weights = tensors
    _load_weights(where, model, weights)
    init = capture(model)
    if info is None:
        return init, {path: digest}
    problem = scaler_problem(info.grad_scaler, enabled=True) if info.grad_scaler else None
    if problem:
        raise UserError(f"{where}: its GradScaler state is not one torch loads ({problem}); save it with "
                        f"scaler.state_dict(), or drop it")
    optim = {k: v for k, v in tensors.items() if k.startswith("optim/")}
    kept = Meta(format_version=FORMAT_VERSION, grad_scaler=info.grad_scaler, scheduler=info.scheduler,
                optim_param_groups=info.optim_param_groups, optim_scalars=info.optim_scalars)
    return Checkpoint(tensors={**init.tensors, **optim}, info=kept), {path: digest}


def _from_dcp(where: str, path: str, model: torch.nn.Module) -> tuple[Checkpoint, dict[str, str]]:
    """``start`` from a torch distributed checkpoint's folder: its weights, and its optimizer's state where it holds one
    (no scheduler, no GradScaler: those of the run that saved it)."""
    from pipeline import dcp

    state, digest = dcp.read(path, where)
    weights, optim = dcp.training_state(state, where, {n: p.shape for n, p in model.named_parameters()})
    _load_weights(where, model, weights)
    init = capture(model)
    if optim is None:
        return init, {path: digest}
    tensors, groups, scalars = _optimizer_parts(optim)
    kept = Meta(format_version=FORMAT_VERSION, grad_scaler={}, scheduler={}, optim_param_groups=groups,
                optim_scalars=scalars)
    return Checkpoint(tensors={**init.tensors, **tensors}, info=kept), {path: digest}


def _load_weights(where: str, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """``weights`` into ``model`` (cast to its dtypes), or one line naming what does not fit."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [f"'{k}' {list(weights[k].shape)} vs the model's {list(v.shape)}" for k, v in own.items()
              if k in weights and weights[k].shape != v.shape]
    if missing or unexpected or shapes:
        said = [f"{len(missing)} missing (e.g. {', '.join(repr(k) for k in missing[:3])})" if missing else "",
                f"{len(unexpected)} unexpected (e.g. {', '.join(repr(k) for k in unexpected[:3])})" if unexpected else "",
                f"{len(shapes)} of another shape ({'; '.join(shapes[:2])})" if shapes else ""]
        raise UserError(f"{where} does not fit task.model: its weights have {', '.join(s for s in said if s)}; give a "
                        f"checkpoint of this model (task.model with these task.options)")
    model.load_state_dict(weights, strict=True)


def _check_tracked(path: str, dvc_file: str | Path) -> None:
    """Refuse a checkpoint that freeze's ``deps`` in dvc.yaml do not list: DVC would not see the file change, and a
    reference frozen from the old file would stand for the new one. No dvc.yaml (a bare run): nothing to check."""
    dvc_file = Path(dvc_file)
    if not dvc_file.is_file():
        return
    import yaml

    stages = (yaml.safe_load(dvc_file.read_text()) or {}).get("stages") or {}
    deps = (stages.get("freeze") or {}).get("deps") or []
    listed = {str(d) for d in deps if isinstance(d, str)}
    if Path(path).as_posix() not in {Path(d).as_posix() for d in listed} and "${reference.checkpoint}" not in listed:
        raise UserError(f"params.yaml: reference.checkpoint {path} is not in freeze's deps in {dvc_file}: DVC would not "
                        f"re-freeze when it changes; add `- {path}` to stages.freeze.deps")


def continue_optimizer(start: Checkpoint, optimizer: torch.optim.Optimizer, name: str, load: Any = None) -> None:
    """The optimizer state a run starts from (``start``'s, where it holds one: its moments, and its param_groups' lr,
    betas, weight decay as saved), put into the run's fresh ``optimizer`` (``name``: reference.optimizer); ``load``: as
    ``restore``'s (FSDP2's shards).

    Raises:
        UserError: the saved state is another optimizer's, or for other parameters."""
    if start.info.optim_param_groups is None:
        return
    groups = start.info.optim_param_groups
    where = "params.yaml: reference.checkpoint's optimizer state"
    if name in ("sgd", "adam", "adamw") and any(("betas" in g) != (name != "sgd") for g in groups):  # Adam's have betas
        raise UserError(f"{where} is not a {name} state (its param_groups hold {sorted(k for k in groups[0] if k != 'params')}); "
                        f"set reference.optimizer to the optimizer that saved it")
    state = _optimizer_state(start)
    # Copies: torch keeps the tensors it is given and updates them in place (SGD's momentum, Adam's moments), which
    # would move ``start`` itself, the start the replicates and the written ``init`` share.
    state["state"] = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items()}
                      for i, entry in state["state"].items()}
    try:
        optimizer.load_state_dict(state) if load is None else load(None, state)
    except (ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{where} does not fit this model's parameters ({first}); save it with the model it "
                        f"trained, or save the weights alone") from None


def continue_schedule(start: Checkpoint, scaler: torch.amp.GradScaler, scheduler: Any) -> None:
    """The scheduler and GradScaler state a run starts from, where ``start`` holds them and the run has one (an enabled
    scaler: float16; a scheduler: reference.lr_schedule)."""
    if scheduler is not None and start.info.scheduler:
        scheduler.load_state_dict(start.info.scheduler)
    if scaler.is_enabled() and start.info.grad_scaler:
        scaler.load_state_dict(start.info.grad_scaler)
