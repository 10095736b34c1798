"""A torch distributed checkpoint (DCP) folder, read in one process with nothing of it executed (reference.checkpoint).

``torch.distributed.checkpoint.save`` writes a folder: ``.metadata`` (a pickle of DCP's dataclasses) and ``__R_I.distcp``
files, in which each tensor chunk and each non-tensor value is one ``torch.save`` archive (a zip of ``data.pkl`` and one
record per storage). DCP's own loader runs ``pickle`` and ``torch.load`` on them. ``torch.load(weights_only=True)`` is no
code barrier before torch 2.6 (CVE-2025-32434) and lets a crafted file corrupt memory before 2.10 (CVE-2026-24747), and
the project supports torch 2.4. So this module reads the folder itself, the same on every torch, and calls neither:

- the folder: regular files alone (no symbolic link, FIFO or device), each hashed as it is read, refused if it changes;
- ``.metadata``: an unpickler that knows DCP's metadata classes, torch.Size, dtypes, layouts and paths, nothing else;
- each archive: stored (uncompressed) zip records alone. Its ``data.pkl`` goes through an unpickler that builds nothing
  of torch: a tensor's pickle is read as a description (dtype, shape, strides, storage), checked against the metadata and
  its storage's record before the record's bytes are taken as they are. A value's pickle may hold plain data alone;
- the storage table: each byte range read once, and all tensors together no larger than the folder's data files.

The chunks of each tensor (one per rank that held a shard) are put together into the full tensor.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import io
import math
import os
import pathlib
import pickle
import stat
import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import UserError

METADATA = ".metadata"
CONVERT = ("load it where torch.distributed.checkpoint imports and save the weights with "
           "safetensors.torch.save_file(model.state_dict(), path)")
AGAIN = "copy the whole folder torch.distributed.checkpoint.save wrote"
_MAX_DEPTH = 32  # elements of a key's path (model.layers.0.attn.wq.weight has 6)
_BLOCK = 1 << 20  # bytes hashed at a time


class Unread:
    """A non-tensor value that is no ``torch.save`` archive of plain data (an ``io.BytesIO`` a Stateful saved, a
    pickled object): left unread. Refused only where it is used."""

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn


def read(folder: str | Path, where: str) -> tuple[dict[str, Any], str]:
    """The folder's state dict, nested as it was saved (``{"model": {...}, "optim": {...}}``), and its digest
    (``folder_digest``). Every file is hashed, and the chunks are read from the same files, unchanged meanwhile.

    Raises:
        UserError: the folder holds a symbolic link or anything but regular files and folders, or a file changed while
            read; this torch cannot import DCP's metadata classes; no ``.metadata``; a metadata pickle that names any
            other class; chunks that name files outside the folder, reuse a byte range, do not cover their tensor, are
            compressed, or are not plain tensors of the metadata's dtype and shape.
    """
    files = _listing(Path(folder), where)
    digest = _digest(files, where)
    if METADATA not in files:
        raise UserError(f"{where} is a folder without {METADATA}: not a torch distributed checkpoint; give a folder "
                        f"torch.distributed.checkpoint.save wrote, or a safetensors file")
    md, classes = _metadata(_read(files[METADATA], METADATA, 0, files[METADATA].size, where), f"{where}/{METADATA}")
    stored = _Stored(files, md.storage_data, where)
    flat: dict[str, Any] = {}
    try:
        for fqn, entry in md.state_dict_metadata.items():
            if isinstance(entry, classes["TensorStorageMetadata"]):
                flat[fqn] = _tensor(fqn, entry, stored, classes["MetadataIndex"], where)
            else:
                flat[fqn] = _value(fqn, stored.bytes(fqn, classes["MetadataIndex"](fqn)))
    except (TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError) as exc:  # its fields' types
        raise UserError(f"{where}/{METADATA} is not readable DCP metadata ({type(exc).__name__}: {_short(str(exc))}); "
                        f"save the checkpoint again with torch.distributed.checkpoint.save") from None
    return _nested(flat, md.planner_data, where), digest


def training_state(
    state: dict[str, Any], where: str, params: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The model's weights and the optimizer's state in a DCP state dict; ``params``: the model's parameters' shapes,
    in ``named_parameters()`` order (the order of the optimizer a run builds on ``model.parameters()``).

    Weights: the tensors under ``model``, else the top level's (``dcp.save(model.state_dict())``, torchtitan's
    layout). The optimizer's: under ``optim`` or ``optimizer``, as ``Optimizer.state_dict()`` (parameters by number:
    the saver's order, taken as the model's) or ``get_optimizer_state_dict`` (by name: numbered in the model's order)
    give it; None where the folder holds none. Both may sit under one top-level key (the DCP recipe's
    ``{"app": AppState(model, optimizer)}``). Anything else (a scheduler, a dataloader, counters) is another run's.

    Raises:
        UserError: the optimizer's state is in another layout (flattened), holds values that are not plain data, names
            a parameter the model has not, or holds a tensor of another shape than its parameter.
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
    ids = [p for g in groups for p in g["params"]] if layout else []
    by_name = bool(ids) and all(isinstance(p, str) for p in ids)  # get_optimizer_state_dict's layout
    numbered = all(type(p) is int and abs(p) < 1 << 63 for p in ids)  # Optimizer.state_dict()'s
    if not layout or not (by_name or numbered) or len(set(ids)) != len(ids):
        raise UserError(f"{where}: its '{key}' is not an optimizer's state_dict (state and param_groups; a flattened "
                        f"one?); {fix}")
    names = list(params)
    # DCP made the state's keys strings: a parameter's name, or its number in the saver's param_groups
    number = {n: i for i, n in enumerate(names)} if by_name else {str(p): i for i, p in enumerate(ids)}
    unknown = next((k for k in [*map(str, ids), *optim["state"]] if k not in number), None)
    if unknown is not None:
        of = "task.model" if by_name else "its param_groups"
        raise UserError(f"{where}: its '{key}' holds state for {_q(unknown)}, no parameter of {of}; save it with the "
                        f"model it trained (get_optimizer_state_dict(model, optimizer)), or the weights alone")
    values = [v for g in groups for k, v in g.items() if k != "params"]
    values += [v for entry in optim["state"].values() if isinstance(entry, dict) for v in entry.values()
               if not torch.is_tensor(v)]
    if not all(isinstance(v, dict) for v in optim["state"].values()) or not all(_plain(v) for v in values):
        raise UserError(f"{where}: its '{key}' holds values that are not plain data; {fix}")
    state_by_number = {number[k]: dict(v) for k, v in optim["state"].items()}
    for i, entry in state_by_number.items():
        if i >= len(names):
            raise UserError(f"{where}: its '{key}' holds state for parameter {i}, and task.model has {len(names)}; save "
                            f"it with the model it trained, or the weights alone")
        odd = next((k for k, v in entry.items() if torch.is_tensor(v) and v.dim() and v.shape != params[names[i]]), None)
        if odd is not None:
            raise UserError(f"{where}: its '{key}' holds {_q(str(odd))} of shape {list(entry[odd].shape)} for parameter "
                            f"'{names[i]}' of shape {list(params[names[i]])}: another model's, or another order of its "
                            f"parameters; save it with get_optimizer_state_dict(model, optimizer), or the weights alone")
    return weights, {
        "state": state_by_number,
        "param_groups": [{**g, "params": sorted(number[str(p)] for p in g["params"]) if by_name
                          else [number[str(p)] for p in g["params"]]} for g in groups],
    }


def _plain(value: Any, limit: int = 1 << 20) -> bool:
    """JSON's data (a param group's lr, its betas): what a checkpoint's metadata can hold. At most ``limit`` values,
    16 deep: a pickle's shared references can make a small file an endless tree."""
    pending, seen = [(value, 0)], 0
    while pending:
        v, depth = pending.pop()
        seen += 1
        if seen > limit or depth > 16:
            return False
        if isinstance(v, (list, tuple)):
            pending.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                return False
            pending.extend((x, depth + 1) for x in v.values())
        elif not (v is None or isinstance(v, (bool, float, str)) or (isinstance(v, int) and abs(v) < 1 << 63)):
            return False
    return True


def _q(text: str) -> str:
    """A name from the folder, quoted and cut for a one-line message (it may be long or hold line breaks)."""
    return ascii(text if len(text) <= 80 else text[:80] + "...")


def _short(text: str) -> str:
    return ascii(text[:120])[1:-1]


def _shown(values: tuple) -> str:
    """Numbers from the metadata for a message: ints alone, never the str of whatever else its pickle held (a shared
    list's str can be of any size)."""
    said = [str(v) if type(v) is int and abs(v) < 1 << 63 else "?" for v in values[:8]]
    return "[" + ", ".join(said) + (", ...]" if len(values) > 8 else "]")


# --- the folder's files: regular files alone, hashed as read, unchanged while read --------------------------------------


@dataclass(frozen=True)
class _File:
    path: Path
    identity: tuple[int, int, int, int]  # device, inode, size, mtime (ns): the file as listed

    @property
    def size(self) -> int:
        return self.identity[2]


def _listing(folder: Path, where: str) -> dict[str, _File]:
    """The folder's files by relative name. The folder may be a link the user made; nothing in it may be one."""
    root = folder.resolve()
    files: dict[str, _File] = {}
    pending = [root]
    try:
        while pending:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    info = entry.stat(follow_symlinks=False)
                    name = Path(entry.path).relative_to(root).as_posix()
                    if stat.S_ISDIR(info.st_mode):
                        pending.append(Path(entry.path))
                    elif stat.S_ISREG(info.st_mode):
                        files[name] = _File(Path(entry.path), _identity(info))
                    else:
                        raise UserError(f"{where}: {_q(name)} is {_kind(info.st_mode)}, not a file of the folder: nothing "
                                        f"outside it is read; copy the files themselves in")
    except OSError as exc:
        raise UserError(f"{where} cannot be listed ({type(exc).__name__}: {_short(exc.strerror or '')}); make the "
                        f"folder readable") from None
    return files


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _kind(mode: int) -> str:
    kinds = {stat.S_ISLNK: "a symbolic link", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a device", stat.S_ISBLK: "a device"}
    return next((said for test, said in kinds.items() if test(mode)), "not a regular file")


def _open(file: _File, name: str, where: str) -> int:
    """A descriptor of ``file`` as listed: never through a link, never blocking on a FIFO put in its place."""
    try:
        fd = os.open(file.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise UserError(f"{where}: {_q(name)} cannot be opened ({type(exc).__name__}: {_short(exc.strerror or '')}); "
                        f"make it a readable file, or run again once its save has finished") from None
    try:
        _unchanged(fd, file, name, where)
    except UserError:
        os.close(fd)
        raise
    return fd


def _unchanged(fd: int, file: _File, name: str, where: str) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or _identity(info) != file.identity:
        raise UserError(f"{where}: {_q(name)} changed while it was read; run again once its save has finished")


def _pread(fd: int, start: int, length: int, file: _File, name: str, where: str) -> bytearray:
    """``length`` bytes from ``start`` (within the file: the caller checked), the file unchanged meanwhile."""
    buffer = bytearray(length)
    view, done = memoryview(buffer), 0
    while done < length:
        got = os.preadv(fd, [view[done:]], start + done)  # one read stops short of 2 GiB
        if got <= 0:
            break
        done += got
    if done < length:
        raise UserError(f"{where}: {_q(name)} changed while it was read; run again once its save has finished")
    _unchanged(fd, file, name, where)
    return buffer


def _read(file: _File, name: str, start: int, length: int, where: str) -> bytearray:
    fd = _open(file, name, where)
    try:
        return _pread(fd, start, length, file, name, where)
    finally:
        os.close(fd)


def _digest(files: dict[str, _File], where: str) -> str:
    """sha256 over the files, in name order: each relative name, its length and its bytes, one block at a time."""
    digest = hashlib.sha256()
    for name in sorted(files):
        file = files[name]
        digest.update(f"{name}\0{file.size}\0".encode())
        fd = _open(file, name, where)
        try:
            for start in range(0, file.size, _BLOCK):
                digest.update(_pread(fd, start, min(_BLOCK, file.size - start), file, name, where))
        finally:
            os.close(fd)
    return digest.hexdigest()


def folder_digest(folder: str | Path) -> str:
    """The digest ``read`` gives a folder (reference.checkpoint's entry in freeze's manifest)."""
    files = _listing(Path(folder), str(folder))
    return _digest(files, str(folder))
# --- .metadata: DCP's classes alone -------------------------------------------------------------------------------------


def _classes() -> dict[str, Any]:
    """DCP's metadata classes in this torch, by name; a refusal in one line where it has none."""
    try:
        from torch.distributed.checkpoint import filesystem, metadata
    except Exception as exc:  # ImportError, or a torch built without torch.distributed
        raise UserError(f"this torch ({torch.__version__}) cannot read torch distributed checkpoints "
                        f"(torch.distributed.checkpoint does not import: {_short(str(exc))}); {CONVERT}") from None
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


_KEY_INT = (1 << 61) - 1  # below it an int hashes to itself: keys that cannot collide
_DTYPES = frozenset(getattr(torch, n) for n in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64", "int32", "int16", "int8",
    "uint8", "bool") if hasattr(torch, n))
"""What safetensors holds, and so what a checkpoint's weights and optimizer state may be here (no complex, no bits)."""
_MAX_DIMS = 64


class _PlainKeys(pickle._Unpickler):
    """Dict keys as DCP's pickles hold them and nothing else: a str, a small non-negative int, or (``key``) an object the
    subclass allows. Hashing anything else could recurse without bound in C (a tuple nested a million deep) or cost
    2^depth (a tuple of itself, twice, by the memo); sets and frozensets, which DCP never pickles, are refused."""

    def key(self, value: Any) -> bool:
        return False

    def _keys(self, keys) -> None:  # noqa: ANN001
        for k in keys:
            if not (type(k) is str or (type(k) is int and 0 <= k < _KEY_INT) or self.key(k)):
                raise pickle.UnpicklingError(f"it keys a dict by a {type(k).__name__}, which DCP's pickles never do")

    def load_setitem(self) -> None:
        self._keys([self.stack[-2]])
        super().load_setitem()

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._keys(items[0::2])
        target = self.stack[-1]
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_dict(self) -> None:
        items = self.pop_mark()
        self._keys(items[0::2])
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def refused(self) -> None:
        raise pickle.UnpicklingError("it builds a set, which DCP's pickles never do")

    dispatch = {**pickle._Unpickler.dispatch, pickle.SETITEM[0]: load_setitem, pickle.SETITEMS[0]: load_setitems,
                pickle.DICT[0]: load_dict, pickle.EMPTY_SET[0]: refused, pickle.ADDITEMS[0]: refused,
                pickle.FROZENSET[0]: refused}


class _Restricted(_PlainKeys):  # Python's own unpickler in Python: its BUILD can be checked, unlike C's
    """Loads DCP's metadata pickle, and nothing else: any other global is refused before it is looked up, and state is
    set on fresh instances of DCP's classes alone (a BUILD on a class or a shared object would change it process-wide)."""

    def __init__(self, raw: bytes, allowed: dict[tuple[str, str], Any], buildable: tuple[type, ...], index: type,
                 properties: type, memory_format: type | None) -> None:
        super().__init__(io.BytesIO(raw))
        self.allowed, self.buildable = allowed, buildable
        self.index, self.properties, self.memory_format = index, properties, memory_format

    def key(self, value: Any) -> bool:
        """A ``MetadataIndex`` (the storage table's key) of a str name and small non-negative int offsets."""
        if type(value) is not self.index or not isinstance(vars(value).get("fqn"), str):
            return False
        offset, at = vars(value).get("offset"), vars(value).get("index")
        return (offset is None or (type(offset) is torch.Size and len(offset) <= _MAX_DIMS
                                   and all(type(v) is int and 0 <= v < _KEY_INT for v in offset))) \
            and (at is None or (type(at) is int and 0 <= at < _KEY_INT))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        value = vars(torch).get(name) if module == "torch" else None  # vars: no lazy import of a torch submodule
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"it names {_short(str(module))}.{_short(str(name))}, none of DCP's metadata "
                                     f"classes in torch {torch.__version__}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP metadata never holds")

    def load_build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]  # BUILD pops the state, then sets it on the object under it
        if isinstance(target, type) or not isinstance(target, self.buildable):
            what = target.__name__ if isinstance(target, type) else type(target).__name__  # never str(target): any size
            raise pickle.UnpicklingError(f"it sets the state of {'type ' if isinstance(target, type) else ''}"
                                         f"{_short(what)}, which DCP metadata never does")
        if isinstance(target, self.properties):  # TensorProperties.__setstate__: a 5-tuple, its memory format DCP's enum
            plain = type(state) is tuple and len(state) == 5 and (
                self.memory_format is None or isinstance(state[3], self.memory_format))
        else:  # a dataclass's fields by name, no more (no __setstate__ or __class__ slipped in)
            names = {f.name for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else set()
            plain = type(state) is dict and all(type(k) is str and k in names for k in state)
        if not plain:
            raise pickle.UnpicklingError(f"it sets a {type(target).__name__} to a state DCP never writes")
        super().load_build()

    dispatch = {**_PlainKeys.dispatch, pickle.BUILD[0]: load_build}


def _layout(name: Any) -> torch.layout:
    """``torch.serialization._get_layout`` of a short name alone (it hashes its argument: any object could cost 2^n)."""
    if type(name) is not str or len(name) > 64:
        raise pickle.UnpicklingError("it names a layout by something other than its name")
    return torch.serialization._get_layout(name)


def _member(enum: type, value: Any) -> Any:
    """A member of DCP's memory-format enum from its int alone (the enum's own error would print any object)."""
    if type(value) is not int or not 0 <= value < 64:
        raise pickle.UnpicklingError("it names a memory format by something other than its number")
    return enum(value)


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
        allowed[("torch.serialization", "_get_layout")] = _layout
    memory_format = classes.get("_MEM_FORMAT_ENCODING")
    if memory_format is not None:  # an Enum, rebuilt from its int: nothing else reaches it (its error prints the value)
        allowed[(memory_format.__module__, memory_format.__qualname__)] = functools.partial(_member, memory_format)
    try:
        md = _Restricted(raw, allowed, tuple(c for n, c in classes.items() if n != "_MEM_FORMAT_ENCODING"),
                         classes["MetadataIndex"], classes["TensorProperties"], memory_format).load()
    except pickle.UnpicklingError as exc:
        raise UserError(f"{where} was refused unread ({exc}): a DCP folder's metadata holds DCP's classes alone; "
                        f"nothing of it was run. Save the checkpoint again with torch.distributed.checkpoint.save") from None
    except Exception as exc:  # a damaged pickle: only the allowed classes ran
        raise UserError(f"{where} is not readable DCP metadata ({type(exc).__name__}: {_short(str(exc))}); save the "
                        f"checkpoint again with torch.distributed.checkpoint.save") from None
    kinds = (classes["TensorStorageMetadata"], classes["BytesStorageMetadata"])
    fields = vars(md) if isinstance(md, classes["Metadata"]) else {}
    entries, table = fields.get("state_dict_metadata"), fields.get("storage_data")  # absent where no BUILD ran
    problem = (
        "not DCP's Metadata" if not isinstance(md, classes["Metadata"])
        else "its entries are not DCP's" if not isinstance(entries, dict) or not all(
            isinstance(k, str) and isinstance(v, kinds) for k, v in entries.items())
        else "its storage table is not DCP's" if not isinstance(table, dict) or not all(
            isinstance(k, classes["MetadataIndex"]) and isinstance(v, classes["_StorageInfo"]) for k, v in table.items())
        else None
    )
    if problem:
        raise UserError(f"{where} is not readable DCP metadata ({problem}); save the checkpoint again with "
                        f"torch.distributed.checkpoint.save")
    return md, classes


# --- the storage table: byte ranges of the data files, each read once ---------------------------------------------------


class _Stored:
    """The data files as the storage table slices them. Each byte range is read once (a range many entries name
    would cost the folder's size each time), and the tensors built are no larger in all than the data files."""

    def __init__(self, files: dict[str, _File], storage: dict, where: str) -> None:
        self.files, self.storage, self.where = files, storage, where
        self.total = sum(f.size for n, f in files.items() if n != METADATA)
        self.left = self.total
        self.used: dict[str, list[tuple[int, int]]] = {}

    def claim(self, fqn: str, size: tuple[int, ...], dtype: torch.dtype) -> None:
        """Room for a tensor of ``size`` and ``dtype``, refused before it is allocated (a crafted size is no bomb)."""
        self.left -= math.prod(size) * dtype.itemsize
        if self.left < 0:
            raise UserError(f"{self.where}: {_q(fqn)} is {_shown(size)} {dtype}: with the tensors before it, more than the "
                            f"folder's {self.total:,} bytes hold; {AGAIN}")

    def bytes(self, fqn: str, index: Any) -> bytearray:
        """The bytes the storage table gives for ``index``: a range of a data file of the folder, never used before."""
        info = self.storage.get(index)
        where = self.where
        if info is None:
            raise UserError(f"{where}: {_q(fqn)} has no entry in its metadata's storage table (a rank's files "
                            f"missing?); {AGAIN}")
        name, start, length = info.relative_path, info.offset, info.length
        if not isinstance(name, str) or name not in self.files or "/" in name or name == METADATA:
            said = _q(name) if isinstance(name, str) else f"a {type(name).__name__}"
            raise UserError(f"{where}: {_q(fqn)} is stored in {said}, no data file of the folder; {AGAIN}")
        size = self.files[name].size
        if not (type(start) is int and type(length) is int and 0 <= start and 0 <= length and start + length <= size):
            raise UserError(f"{where}: {_q(fqn)} lies outside {_q(name)} (bytes {_shown((start, length))} of {size}): "
                            f"the file is truncated; copy it again")
        if getattr(info, "transform_descriptors", None):
            raise UserError(f"{where}: {_q(fqn)} is stored transformed (a storage extension: compression?); save the "
                            f"checkpoint without one")
        used = self.used.setdefault(name, [])
        at = bisect.bisect(used, (start, start + length))
        if length and ((at and used[at - 1][1] > start) or (at < len(used) and used[at][0] < start + length)):
            raise UserError(f"{where}: {_q(fqn)} is stored in bytes {start}+{length} of {_q(name)}, which another entry "
                            f"uses too: a crafted or damaged storage table; {AGAIN}")
        used.insert(at, (start, start + length))
        return _read(self.files[name], name, start, length, where)


def _tensor(fqn: str, entry: Any, stored: _Stored, index: type, where: str) -> torch.Tensor:
    """The full tensor from its chunks (one per shard that held part of it), each read as a plain tensor."""
    dtype, size = entry.properties.dtype, tuple(entry.size)
    if dtype not in _DTYPES:
        said = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else "no torch dtype"
        raise UserError(f"{where}: {_q(fqn)} is {said} in its metadata, no dtype a model's weights or optimizer state "
                        f"hold; save the checkpoint again, or as safetensors")
    if not (len(size) <= _MAX_DIMS and all(type(d) is int and 0 <= d < _KEY_INT for d in size)):
        raise UserError(f"{where}: {_q(fqn)} has no shape in its metadata ({_shown(size)}); save the checkpoint again")
    stored.claim(fqn, size, dtype)
    full, covered = torch.empty(size, dtype=dtype), torch.zeros(size, dtype=torch.bool)
    for chunk in entry.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if not (len(offsets) == len(sizes) == len(size) and all(type(v) is int for v in offsets + sizes)
                and all(0 <= o and 0 <= s and o + s <= d for o, s, d in zip(offsets, sizes, size))):
            raise UserError(f"{where}: a chunk of {_q(fqn)} lies outside it ({_shown(sizes)} at {_shown(offsets)} of "
                            f"{_shown(size)}); {AGAIN}")
        part = _chunk(stored.bytes(fqn, index(fqn, torch.Size(offsets))), dtype, sizes, fqn, where)
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        if covered[region].any():
            raise UserError(f"{where}: chunks of {_q(fqn)} overlap ({_shown(sizes)} at {_shown(offsets)} of {_shown(size)}); "
                            f"{AGAIN}")
        full[region] = part
        covered[region] = True
    if not bool(covered.all()):
        raise UserError(f"{where}: the chunks of {_q(fqn)} leave part of its {_shown(size)} unsaved (a rank's file "
                        f"missing?); {AGAIN}")
    return full


def _value(fqn: str, raw: bytearray) -> Any:
    """A non-tensor value (a learning rate, a param group's list): the plain data of a ``torch.save`` archive, or
    ``Unread`` where it is no such thing (raw bytes a Stateful saved, a pickled object)."""
    try:
        value = _Payload(_archive(raw)["data.pkl"], tensors=False).load()
    except Exception:  # nothing but plain data was built
        return Unread(fqn)
    return value if _plain(value) else Unread(fqn)


# --- one torch.save archive, read without torch.load ---------------------------------------------------------------------


class _Refused(Exception):
    """Why an archive is no plain tensor's: said in the caller's one line."""


class _View:
    """``raw`` as a file for ``zipfile`` to read its central directory from, without a copy."""

    def __init__(self, raw: bytearray) -> None:
        self.raw, self.at = memoryview(raw), 0

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = max(0, (0, self.at, len(self.raw))[whence] + offset)
        return self.at

    def tell(self) -> int:
        return self.at

    def read(self, n: int = -1) -> bytes:
        end = len(self.raw) if n is None or n < 0 else min(len(self.raw), self.at + n)
        data = bytes(self.raw[self.at : end])
        self.at = max(self.at, end)
        return data


def _archive(raw: bytearray) -> dict[str, memoryview]:
    """The records of one ``torch.save`` archive by name under its top folder (``data.pkl``, ``data/0``), each a view
    of ``raw``. Stored records alone: a deflated one could inflate a thousandfold before anything is checked."""
    try:
        infos = zipfile.ZipFile(_View(raw)).infolist()  # the central directory alone: nothing is decompressed
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error, NotImplementedError) as exc:
        raise _Refused(f"not a torch.save archive: {_short(str(exc))}") from None
    records: dict[str, memoryview] = {}
    view = memoryview(raw)
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.compress_size != info.file_size:
            raise _Refused(f"its record {_q(info.orig_filename)} is compressed or encrypted, which torch.save never does")
        at = info.header_offset
        if at < 0:  # zipfile subtracts a central directory's stated offset: a crafted one goes below the file
            raise _Refused(f"its record {_q(info.orig_filename)} has a header before the archive")
        head = bytes(view[at : at + 30])
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise _Refused(f"its record {_q(info.orig_filename)} has no local header")
        named, extra = struct.unpack("<HH", head[26:30])
        start = at + 30 + named + extra
        if bytes(view[at + 30 : at + 30 + named]) != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
            raise _Refused(f"its record {_q(info.orig_filename)} is named otherwise in its local header")
        if start + info.file_size > len(raw):
            raise _Refused(f"its record {_q(info.orig_filename)} ends past the archive")
        name = info.orig_filename.split("/", 1)[-1]
        if name in records:
            raise _Refused(f"it holds {_q(name)} twice")
        records[name] = view[start : start + info.file_size]
    if "data.pkl" not in records:
        raise _Refused("it holds no data.pkl")
    return records


@dataclass(frozen=True)
class _StorageType:
    """A storage class a tensor's pickle names (``torch.FloatStorage``): its dtype, no class of torch."""

    dtype: torch.dtype
    untyped: bool


@dataclass(frozen=True)
class _StorageRef:
    kind: _StorageType
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    """A tensor as its pickle describes it, nothing allocated: its storage, offset, size and strides (in elements)."""

    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@functools.cache
def _storage_types() -> dict[tuple[str, str], _StorageType]:
    typed = {("torch", name): _StorageType(dtype, False) for dtype, name in
             torch.storage._dtype_to_storage_type_map().items() if not name.startswith("Q")}  # no quantized storage
    return typed | {(m, "UntypedStorage"): _StorageType(torch.uint8, True) for m in ("torch", "torch.storage")}


def _describe(storage: Any, offset: Any, size: Any, stride: Any, hooks: Any, dtype: Any, metadata: Any) -> _TensorRef:
    if not (isinstance(storage, _StorageRef) and type(offset) is int and offset >= 0 and _counts(size) and _counts(stride)
            and len(size) == len(stride) and isinstance(dtype, torch.dtype) and hooks == {}
            and (metadata is None or (isinstance(metadata, dict) and not any(metadata.values())))):
        raise pickle.UnpicklingError("its tensor is described by other values than torch.save writes")
    return _TensorRef(storage, offset, size, stride, dtype)


def _counts(values: Any) -> bool:
    return type(values) is tuple and all(type(v) is int and v >= 0 for v in values)


def _rebuild_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None):  # noqa: ANN001, ANN202
    """torch._utils._rebuild_tensor_v2 of a typed storage, as a description."""
    dtype = storage.kind.dtype if isinstance(storage, _StorageRef) and not storage.kind.untyped else None
    return _describe(storage, offset, size, stride, hooks, dtype, metadata)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):  # noqa: ANN001, ANN202
    """torch._utils._rebuild_tensor_v3 (float8 and other dtypes of an untyped storage), as a description."""
    untyped = isinstance(storage, _StorageRef) and storage.kind.untyped
    return _describe(storage if untyped else None, offset, size, stride, hooks, dtype, metadata)


def _ordered_dict(*args: Any) -> dict:
    return dict(*args)


class _Payload(_PlainKeys):
    """An archive's ``data.pkl``: a tensor's (``tensors``), read as a ``_TensorRef``, or a value's, plain data alone.
    No global but those named here is looked up, no object of torch is built, no state is set on anything."""

    def __init__(self, raw: memoryview, tensors: bool) -> None:
        super().__init__(io.BytesIO(raw))
        self.tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if self.tensors:
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return _rebuild_v2
            if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
                return _rebuild_v3
            if (module, name) == ("collections", "OrderedDict"):
                return _ordered_dict
            if (module, name) in (types := _storage_types()):
                return types[module, name]
            if module == "torch" and isinstance(dtype := vars(torch).get(name), torch.dtype):
                return dtype
        raise pickle.UnpicklingError(f"it names {_short(str(module))}.{_short(str(name))}, no part of a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if (self.tensors and type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and type(pid[2]) is str and type(pid[4]) is int and pid[4] >= 0):
            return _StorageRef(pid[1], pid[2], pid[4])
        raise pickle.UnpicklingError("it holds a persistent id that is no storage of a plain tensor")

    def load_build(self) -> None:
        raise pickle.UnpicklingError("it sets the state of an object, which a plain tensor's pickle never does")

    dispatch = {**_PlainKeys.dispatch, pickle.BUILD[0]: load_build}


def _chunk(raw: bytearray, dtype: torch.dtype, sizes: tuple[int, ...], fqn: str, where: str) -> torch.Tensor:
    """One chunk's tensor, its bytes taken as they are from its storage's record, after its pickle's description was
    checked against the metadata (dtype, shape) and the record (its length, the strides' reach)."""
    try:
        records = _archive(raw)
        ref = _Payload(records["data.pkl"], tensors=True).load()
        if not isinstance(ref, _TensorRef):
            raise _Refused(f"it holds a {type(ref).__name__}")
    except (_Refused, pickle.UnpicklingError) as exc:
        why = _short(str(exc))
    except Exception as exc:  # a damaged pickle: nothing but the descriptions above was built
        why = f"{type(exc).__name__}: {_short(str(exc))}"
    else:
        why = None
    if why is not None:
        raise UserError(f"{where}: a chunk of {_q(fqn)} is no plain tensor's archive ({why}); nothing of it was run: "
                        f"save the checkpoint again with torch.distributed.checkpoint.save") from None
    if ref.dtype != dtype:  # a cast would load other numbers than were saved, without a word
        raise UserError(f"{where}: a chunk of {_q(fqn)} is stored as {ref.dtype}, and its metadata says {dtype}; save "
                        f"the checkpoint again with torch.distributed.checkpoint.save")
    if ref.size != sizes:
        raise UserError(f"{where}: a chunk of {_q(fqn)} is {_shown(ref.size)}, and its metadata says "
                        f"{_shown(sizes)}; {AGAIN}")
    record = records.get(f"data/{ref.storage.key}")
    nbytes = ref.storage.numel * (1 if ref.storage.kind.untyped else ref.storage.kind.dtype.itemsize)
    order = bytes(records.get("byteorder", sys.byteorder.encode()))  # torch before 1.12 wrote none: the saver's own
    reach = ref.offset + sum((s - 1) * st for s, st in zip(ref.size, ref.stride)) + 1 if math.prod(ref.size) else 0
    problem = (
        "no record for its storage" if record is None
        else f"its storage's record has {len(record)} bytes, and its pickle says {nbytes}" if len(record) != nbytes
        else f"its storage's {nbytes} bytes are no whole number of {dtype}" if nbytes % dtype.itemsize
        else f"its strides reach past its storage's {nbytes // dtype.itemsize} elements" if reach * dtype.itemsize > nbytes
        else f"it was saved {_short(order.decode(errors='replace'))}-endian" if order != sys.byteorder.encode()
        else None
    )
    if problem:
        raise UserError(f"{where}: a chunk of {_q(fqn)} is no plain tensor's archive ({problem}); save the checkpoint "
                        f"again with torch.distributed.checkpoint.save")
    if not reach:
        return torch.empty(sizes, dtype=dtype)
    as_bytes = torch.frombuffer(record, dtype=torch.uint8)  # the record's own bytes: read, never interpreted by a pickle
    if as_bytes.data_ptr() % dtype.itemsize:  # a crafted archive's record may sit anywhere: aligned for the dtype's kernels
        as_bytes = as_bytes.clone()
    if dtype == torch.bool:  # a byte other than 0 or 1 is no bool torch may hold
        flat = as_bytes.ne(0)
    else:
        flat = as_bytes.view(dtype)
    return torch.as_strided(flat, ref.size, ref.stride, ref.offset)


# --- the nesting DCP flattened ------------------------------------------------------------------------------------------


def _nested(flat: dict[str, Any], planner_data: Any, where: str) -> dict[str, Any]:
    """The state dict as saved: DCP flattens nested dicts and lists into dotted keys and keeps each key's path (str:
    a dict key, int: a list position) in ``planner_data``; without it, the keys are the top level's. Lists grow to no
    more places than there are entries, and paths are at most ``_MAX_DEPTH`` long (a crafted path is no memory bomb)."""
    paths = planner_data if isinstance(planner_data, dict) and planner_data else {k: (k,) for k in flat}
    root: dict[str, Any] = {}
    room = [len(flat)]  # list places left to grow
    try:
        for fqn, value in flat.items():
            path = paths[fqn]
            if (not isinstance(path, (tuple, list)) or not 0 < len(path) <= _MAX_DEPTH
                    or not all(isinstance(k, str) or (type(k) is int and 0 <= k < len(flat)) for k in path)):
                raise ValueError(f"the path of {_q(fqn)}")
            node: Any = root
            for key, nxt in zip(path, path[1:]):
                node = _slot(node, key, lambda nxt=nxt: [] if isinstance(nxt, int) else {}, room)
            _slot(node, path[-1], lambda value=value: value, room)
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        said = f"no path for {_q(str(exc.args[0]))}" if isinstance(exc, KeyError) and exc.args else _short(str(exc))
        raise UserError(f"{where}/{METADATA}: its key paths do not fit its entries ({said}); save the checkpoint again "
                        f"with torch.distributed.checkpoint.save") from None
    return root


def _slot(node: Any, key: Any, make: Any, room: list[int]) -> Any:
    """``node[key]``, made by ``make()`` where absent (a list grows to ``key``, out of ``room``)."""
    if isinstance(node, list):
        if type(key) is not int:
            raise TypeError(f"key {_q(str(key))} in a list")
        grow = key + 1 - len(node)
        if grow > 0:
            room[0] -= grow
            if room[0] < 0:
                raise ValueError("its list positions leave more places than it has entries")
            node.extend([None] * grow)
        if node[key] is None:
            node[key] = make()
        return node[key]
    if not isinstance(node, dict):
        raise TypeError(f"key {_q(str(key))} in a value")
    if key not in node:
        node[key] = make()
    return node[key]
