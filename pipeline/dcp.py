"""A torch distributed checkpoint (DCP) folder, read in one process with nothing of it executed (reference.checkpoint).

``torch.distributed.checkpoint.save`` writes a folder: ``.metadata`` (a pickle of DCP's dataclasses) and ``__R_I.distcp``
files (one ``torch.save`` stream per tensor chunk or non-tensor value). DCP's own loader unpickles ``.metadata`` with
plain ``pickle`` and non-tensor values with ``torch.load(weights_only=False)``: either runs any code a file holds. So this
module reads the folder itself. ``.metadata`` goes through an unpickler that knows DCP's metadata classes, torch.Size,
dtypes, layouts and paths, and refuses any other name. Each chunk and value goes through ``torch.load(weights_only=True)``.
The chunks of each tensor (one per rank that held a shard) are put together into the full tensor.
"""

from __future__ import annotations

import hashlib
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import UserError

METADATA = ".metadata"
CONVERT = ("load it where torch.distributed.checkpoint imports and save the weights with "
           "safetensors.torch.save_file(model.state_dict(), path)")
_MAX_INDEX = 1 << 20  # a list position in the saved structure (a param group): a crafted huge one is refused


class Unread:
    """A non-tensor value that is no ``torch.save`` stream of plain data (an ``io.BytesIO`` a Stateful saved, a
    pickled object): left unread. Refused only where it is used."""

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn


def read(folder: str | Path, where: str) -> tuple[dict[str, Any], str]:
    """The folder's state dict, nested as it was saved (``{"model": {...}, "optim": {...}}``), and its digest
    (``folder_digest``), from one read of its files.

    Raises:
        UserError: this torch cannot import DCP's metadata classes; no ``.metadata``; a metadata pickle that names any
            other class; chunks that name files outside the folder, do not cover their tensor, or do not load as plain
            tensors.
    """
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}
    digest = folder_digest(files)
    if METADATA not in files:
        raise UserError(f"{where} is a folder without {METADATA}: not a torch distributed checkpoint; give a folder "
                        f"torch.distributed.checkpoint.save wrote, or a safetensors file")
    md, classes = _metadata(files[METADATA], f"{where}/{METADATA}")
    flat: dict[str, Any] = {}
    try:
        for fqn, entry in md.state_dict_metadata.items():
            if isinstance(entry, classes["TensorStorageMetadata"]):
                flat[fqn] = _tensor(fqn, entry, md.storage_data, files, classes["MetadataIndex"], where)
            else:
                flat[fqn] = _value(fqn, _stored(fqn, md.storage_data, classes["MetadataIndex"](fqn), files, where))
    except (TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError) as exc:  # its fields' types
        raise UserError(f"{where}/{METADATA} is not readable DCP metadata ({type(exc).__name__}: {str(exc)[:120]}); "
                        f"save the checkpoint again with torch.distributed.checkpoint.save") from None
    return _nested(flat, md.planner_data, where), digest


def training_state(state: dict[str, Any], where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The model's weights and the optimizer's state in a DCP state dict.

    Weights: the tensors under ``model``, else the top level's (``dcp.save(model.state_dict())``, torchtitan's
    layout). The optimizer's: under ``optim`` or ``optimizer``, as ``Optimizer.state_dict()`` (parameters by number)
    or ``get_optimizer_state_dict`` (by name) give it, numbered as torch numbers them; None where the folder holds
    none. Both may sit under one top-level key (the DCP recipe's ``{"app": AppState(model, optimizer)}``).
    Anything else (a scheduler, a dataloader, counters) is another run's and is not read.

    Raises:
        UserError: the optimizer's state is in another layout (flattened), or holds values that are not plain data.
    """
    if "model" not in state and len(state) == 1 and isinstance(app := next(iter(state.values())), dict) and "model" in app:
        state = app  # the DCP recipe's {"app": AppState(model, optimizer)}: one Stateful holding both
    model = state.get("model")
    weights = {k: v for k, v in (model if isinstance(model, dict) else state).items() if torch.is_tensor(v)}
    key = next((k for k in ("optim", "optimizer") if k in state), None)
    if key is None:
        return weights, None
    optim = state[key]
    fix = "save optimizer.state_dict() or get_optimizer_state_dict(model, optimizer) under 'optim', or the weights alone"
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    layout = isinstance(optim, dict) and isinstance(optim.get("state"), dict) and isinstance(groups, list) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    if not layout:
        raise UserError(f"{where}: its '{key}' is not an optimizer's state_dict (state and param_groups; a flattened "
                        f"one?); {fix}")
    number = {str(p): i for i, p in enumerate(p for g in groups for p in g["params"])}
    unknown = [k for k, v in optim["state"].items() if str(k) not in number or not isinstance(v, dict)]
    values = [v for g in groups for k, v in g.items() if k != "params"]
    values += [v for entry in optim["state"].values() if isinstance(entry, dict) for v in entry.values()
               if not torch.is_tensor(v)]
    if unknown or not all(_plain(v) for v in values):
        what = f"state for {unknown[0]!r}, no parameter of its param_groups" if unknown else "values that are not plain data"
        raise UserError(f"{where}: its '{key}' holds {what}; {fix}")
    return weights, {
        "state": {number[str(k)]: dict(v) for k, v in optim["state"].items()},
        "param_groups": [{**g, "params": [number[str(p)] for p in g["params"]]} for g in groups],
    }


def _plain(value: Any) -> bool:
    """JSON's data (a param group's lr, its betas): what a checkpoint's metadata can hold."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def folder_digest(files: dict[str, bytes]) -> str:
    """sha256 over a folder's files, in name order: each relative name, its length and its bytes."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{len(files[name])}\0".encode())
        digest.update(files[name])
    return digest.hexdigest()


def _classes() -> dict[str, Any]:
    """DCP's metadata classes in this torch, by name; a refusal in one line where it has none."""
    try:
        from torch.distributed.checkpoint import filesystem, metadata
    except Exception as exc:  # ImportError, or a torch built without torch.distributed
        raise UserError(f"this torch ({torch.__version__}) cannot read torch distributed checkpoints "
                        f"(torch.distributed.checkpoint does not import: {exc}); {CONVERT}") from None
    names = ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
             "TensorProperties")
    found = {n: getattr(metadata, n, None) for n in names} | {"_StorageInfo": getattr(filesystem, "_StorageInfo", None)}
    if None in found.values():
        missing = ", ".join(n for n, c in found.items() if c is None)
        raise UserError(f"this torch ({torch.__version__}) has no {missing} in torch.distributed.checkpoint: it cannot "
                        f"read torch distributed checkpoints; use torch 2.4 or later, or {CONVERT}")
    for optional in ("StorageMeta", "_MEM_FORMAT_ENCODING"):  # not in every torch's pickles, nor in every torch
        if hasattr(metadata, optional):
            found[optional] = getattr(metadata, optional)
    return found


class _Restricted(pickle._Unpickler):  # Python's own unpickler in Python: its BUILD can be checked, unlike C's
    """Loads DCP's metadata pickle, and nothing else: any other global is refused before it is looked up, and state is
    set on fresh instances of DCP's classes alone (a BUILD on a class or a shared object would change it process-wide)."""

    def __init__(self, raw: bytes, allowed: dict[tuple[str, str], Any], buildable: tuple[type, ...]) -> None:
        super().__init__(io.BytesIO(raw))
        self.allowed, self.buildable = allowed, buildable

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        value = vars(torch).get(name) if module == "torch" else None  # vars: no lazy import of a torch submodule
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"it names {module}.{name}, none of DCP's metadata classes in torch {torch.__version__}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP metadata never holds")

    def load_build(self) -> None:
        target = self.stack[-2]  # under the state BUILD pops
        if isinstance(target, type) or not isinstance(target, self.buildable):
            raise pickle.UnpicklingError(f"it sets the state of {type(target).__name__} {str(target)[:60]}, which DCP "
                                         f"metadata never does")
        super().load_build()

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}


def _metadata(raw: bytes, where: str) -> tuple[Any, dict[str, Any]]:
    """The unpickled ``Metadata`` (only DCP's classes built), its shape checked; and the classes."""
    classes = _classes()
    allowed = {(c.__module__, c.__qualname__): c for c in classes.values()}
    allowed |= {
        ("torch", "Size"): torch.Size,
        ("collections", "OrderedDict"): dict,
        ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # StorageMeta.checkpoint_id: the saving machine's path
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    }
    if hasattr(torch.serialization, "_get_layout"):  # how torch pickles a layout: its name's torch.layout, no more
        allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    try:
        md = _Restricted(raw, allowed, tuple(c for n, c in classes.items() if n != "_MEM_FORMAT_ENCODING")).load()
    except pickle.UnpicklingError as exc:
        raise UserError(f"{where} was refused unread ({exc}): a DCP folder's metadata holds DCP's classes alone; "
                        f"nothing of it was run. Save the checkpoint again with torch.distributed.checkpoint.save") from None
    except Exception as exc:  # a damaged pickle: only the allowed classes ran
        raise UserError(f"{where} is not readable DCP metadata ({type(exc).__name__}: {str(exc)[:120]}); save the "
                        f"checkpoint again with torch.distributed.checkpoint.save") from None
    kinds = (classes["TensorStorageMetadata"], classes["BytesStorageMetadata"])
    problem = (
        "not DCP's Metadata" if not isinstance(md, classes["Metadata"])
        else "its entries are not DCP's" if not isinstance(md.state_dict_metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, kinds) for k, v in md.state_dict_metadata.items())
        else "its storage table is not DCP's" if not isinstance(md.storage_data, dict) or not all(
            isinstance(k, classes["MetadataIndex"]) and isinstance(v, classes["_StorageInfo"])
            for k, v in md.storage_data.items())
        else None
    )
    if problem:
        raise UserError(f"{where} is not readable DCP metadata ({problem}); save the checkpoint again with "
                        f"torch.distributed.checkpoint.save")
    return md, classes


def _stored(fqn: str, storage: dict, index: Any, files: dict[str, bytes], where: str) -> bytes:
    """The bytes the storage table gives for ``index``: a slice of a file of the folder, never of another."""
    info = storage.get(index)
    if info is None:
        raise UserError(f"{where}: '{fqn}' has no entry in its metadata's storage table (a rank's files missing?); "
                        f"copy the whole folder torch.distributed.checkpoint.save wrote")
    name, start, length = info.relative_path, info.offset, info.length
    if not isinstance(name, str) or name not in files or "/" in name or name == METADATA:
        raise UserError(f"{where}: '{fqn}' is stored in {name!r}, no data file of the folder; copy the whole folder "
                        f"torch.distributed.checkpoint.save wrote")
    if not (isinstance(start, int) and isinstance(length, int) and 0 <= start and 0 <= length
            and start + length <= len(files[name])):
        raise UserError(f"{where}: '{fqn}' lies outside {name} (bytes {start}+{length} of {len(files[name])}): the "
                        f"file is truncated; copy it again")
    if getattr(info, "transform_descriptors", None):
        raise UserError(f"{where}: '{fqn}' is stored transformed ({', '.join(map(str, info.transform_descriptors))}); "
                        f"save the checkpoint without a storage extension (compression)")
    return files[name][start : start + length]


def _tensor(fqn: str, entry: Any, storage: dict, files: dict[str, bytes], index: type, where: str) -> torch.Tensor:
    """The full tensor from its chunks (one per shard that held part of it), each read as a plain tensor."""
    dtype, size = entry.properties.dtype, torch.Size(entry.size)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"{where}: '{fqn}' has no torch dtype in its metadata; save the checkpoint again")
    stored = sum(len(b) for b in files.values())
    if size.numel() * dtype.itemsize > stored:  # before it is allocated: a crafted size is no memory bomb
        raise UserError(f"{where}: '{fqn}' is {list(size)} {dtype}, more than the folder's {stored:,} bytes hold; copy "
                        f"the whole folder torch.distributed.checkpoint.save wrote")
    full, covered = torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=torch.bool)
    for chunk in entry.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        raw = _stored(fqn, storage, index(fqn, torch.Size(offsets)), files, where)
        try:
            part = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only: only tensors and plain data are built
            raise UserError(f"{where}: '{fqn}' does not load as a plain tensor ({type(exc).__name__}); nothing of it "
                            f"was run: save the checkpoint again with torch.distributed.checkpoint.save") from None
        if (not torch.is_tensor(part) or len(offsets) != len(size) or part.shape != torch.Size(sizes)
                or covered[region].shape != part.shape or covered[region].any()):
            raise UserError(f"{where}: a chunk of '{fqn}' does not fit its place ({list(sizes)} at {list(offsets)} of "
                            f"{list(size)}); copy the whole folder torch.distributed.checkpoint.save wrote")
        full[region] = part.to(dtype)
        covered[region] = True
    if not bool(covered.all()):
        raise UserError(f"{where}: the chunks of '{fqn}' leave part of its {list(size)} unsaved (a rank's file "
                        f"missing?); copy the whole folder torch.distributed.checkpoint.save wrote")
    return full


def _value(fqn: str, raw: bytes) -> Any:
    """A non-tensor value (a learning rate, a param group's list): plain data from ``torch.load(weights_only=True)``,
    or ``Unread`` where the stream is no such thing (raw bytes a Stateful saved, a pickled object)."""
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception:
        return Unread(fqn)


def _nested(flat: dict[str, Any], planner_data: Any, where: str) -> dict[str, Any]:
    """The state dict as saved: DCP flattens nested dicts and lists into dotted keys and keeps each key's path (str:
    a dict key, int: a list position) in ``planner_data``; without it, the keys are the top level's."""
    paths = planner_data if isinstance(planner_data, dict) and planner_data else {k: (k,) for k in flat}
    root: dict[str, Any] = {}
    try:
        for fqn, value in flat.items():
            path = tuple(paths[fqn])
            if not path or not all(isinstance(k, str) or (type(k) is int and 0 <= k < _MAX_INDEX) for k in path):
                raise ValueError(f"the path of '{fqn}'")
            node: Any = root
            for key, nxt in zip(path, path[1:]):
                node = _slot(node, key, lambda nxt=nxt: [] if isinstance(nxt, int) else {})
            _slot(node, path[-1], lambda value=value: value)
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise UserError(f"{where}/{METADATA}: its key paths do not fit its entries ({exc}); save the checkpoint again "
                        f"with torch.distributed.checkpoint.save") from None
    return root


def _slot(node: Any, key: Any, make: Any) -> Any:
    """``node[key]``, made by ``make()`` where absent (a list grows to ``key``)."""
    if isinstance(node, list):
        if type(key) is not int:
            raise TypeError(f"key {key!r} in a list")
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = make()
        return node[key]
    if not isinstance(node, dict):
        raise TypeError(f"key {key!r} in a value")
    if key not in node:
        node[key] = make()
    return node[key]
