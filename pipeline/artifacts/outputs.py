"""The store of per-case outputs: one safetensors file, written and read in chunks of rows.

A fixed set of a real validation holds thousands of cases, and a language model gives a distribution
over its vocabulary at every position: the outputs of freeze and trial need not fit in memory twice.

- ``write_outputs(path, chunks, ids)`` writes the concatenation (along rows, dim 0) of the chunks an
  iterable yields, holding one chunk at a time: the header is known from ``len(ids)`` and the first
  chunk, each tensor's region of the file is reserved up front and each chunk's rows are written at
  their offset. Tensors are laid out by decreasing item size, then name (as safetensors does, so every
  tensor stays aligned), the header is JSON with sorted keys: equal content gives equal bytes.
- ``OutputsReader(path, expected_sha256)`` verifies the file's sha256 first (streamed, 1 MiB at a
  time), validates the header with ``safetensors.safe_open``, then gives a slice of rows two ways:
  ``read`` (one positioned read into a fresh tensor, or into a caller's buffer reused chunk after chunk)
  and ``view`` (the file mapped copy-on-write, the slice's pages faulted in with one ``madvise``, no copy
  at all), which compare uses. Pages of a mapped file stay in the process's resident memory once
  touched, so a mapped reader would grow with the file: ``release`` drops a used slice's pages
  (``MADV_DONTNEED``), and memory stays one chunk. Files written by ``files.write_tensors`` read the
  same way.

Metadata holds ``ids`` (one string per row) as a JSON string, as ``files.write_tensors`` writes it, and, in the
compact store (``store=compact``), ``compact``: the outputs kept as ``artifacts.compact`` parts, decoded on read, and
``compact_version`` (``compact.VERSION``: a file of another format is refused in one line). A trial's compacted output
written beside its reference (``KlAgainst``) keeps each token's KL against the reference's full scores (``compact.KL``,
``OutputsReader.kl``).

Torch-free at import: ``NumpyReader`` reads the same files with safetensors' numpy loader, for the report
stage, which never imports torch; the torch paths import it inside.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from pipeline.artifacts import compact
from pipeline.errors import UserError
from pipeline.files import atomic_file, from_jsonable, rerun, sha256_file, to_jsonable, verify

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pipeline.config import TaskConfig

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
"""Fault a mapped range in with one call (Linux >= 5.14; older kernels refuse it and pages fault on use)."""

_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
"""torch dtype name -> safetensors dtype code, for the dtypes outputs are written in."""


def _code(dtype: torch.dtype) -> str | None:
    return _CODES.get(str(dtype).removeprefix("torch."))


def _torch_dtype(code: str) -> torch.dtype:
    import torch

    return getattr(torch, next(name for name, c in _CODES.items() if c == code))


def write_outputs(
    path: str | Path, chunks: Iterable[dict[str, torch.Tensor]], ids: list[str], meta: dict[str, Any] | None = None,
    store: compact.Store = "full", task: TaskConfig | None = None, kl_against: KlAgainst | None = None,
) -> str:
    """Write the row-wise concatenation of ``chunks`` to one safetensors file, atomically; return its sha256.

    Every chunk names the same tensors, with the same dtype and the same shape past dim 0; their rows
    add up to ``len(ids)``. At most one chunk is held (plus the header). ``meta`` adds metadata keys.
    ``store`` (``compare.store``): ``compact`` writes per-token float32 scores in the compact form
    (``artifacts.compact``; metadata ``compact`` names them), ``auto`` does so above ``compact.AUTO_BYTES``;
    a file with none compacted is the full store's, byte for byte. ``task`` says what the compact form must keep
    exactly: a regression's outputs are never compacted, and a classification's rows keep their ``task.top_k`` best
    classes exactly (``compact.encode``); None: a classification of ``compact.KEEP``. ``kl_against`` (a trial's): each
    compacted output that its reference stores full also keeps each token's KL against it (``compact.KL``), which the
    trial's decoded scores could not give exactly.

    Raises:
        ValueError: no chunk, chunks that disagree in names, dtype or shape, or rows that do not add up, or a
            reference (``kl_against``) of other ids.
    """
    path = Path(path)
    ids = [str(i) for i in ids]
    n_rows = len(ids)
    iterator = iter(chunks)
    first = next(iterator, None)
    if first is None:
        raise ValueError(f"{path}: write_outputs got no chunk; give at least one (it may have 0 rows)")
    squeezed = compact.chosen(store, {k: (n_rows, *v.shape[1:]) for k, v in first.items()},
                              {k: str(v.dtype).removeprefix("torch.") for k, v in first.items()},
                              task.kind if task is not None else "classification")
    if squeezed:
        keep = task.top_k if task is not None else compact.KEEP
        meta = {"compact_version": compact.VERSION, **(meta or {}), "compact": squeezed}
        against = _against(kl_against, squeezed, first, ids, path) if kl_against is not None else None
        encoded = _encoding(first, iterator, squeezed, keep, against, n_rows)
        first, iterator = next(encoded), encoded
    layout = _layout(first, n_rows)
    metadata = {k: json.dumps(to_jsonable(v), sort_keys=True) for k, v in {**(meta or {}), "ids": ids}.items()}
    header_obj: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, trailing, row_bytes) in layout.items():
        size = row_bytes * n_rows
        header_obj[name] = {"dtype": _code(dtype), "shape": [n_rows, *trailing], "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(header_obj, sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    base = 8 + len(header)
    with atomic_file(path) as handle:
        handle.write(len(header).to_bytes(8, "little") + header)
        handle.truncate(base + offset)
        row = 0
        chunk: dict[str, torch.Tensor] | None = first
        while chunk is not None:
            rows = _check_chunk(chunk, layout, path)
            if row + rows > n_rows:
                raise ValueError(f"{path}: the chunks hold more rows than the {n_rows} ids")
            for name, (_, _, row_bytes) in layout.items():
                if rows:
                    handle.seek(base + header_obj[name]["data_offsets"][0] + row * row_bytes)
                    handle.write(_raw(chunk[name]))
            row += rows
            chunk = next(iterator, None)
        if row != n_rows:
            raise ValueError(f"{path}: the chunks hold {row} rows for {n_rows} ids; give one row per id")
    return sha256_file(path)


@dataclass(frozen=True)
class KlAgainst:
    """What a trial's compacted outputs keep each token's KL against (``write_outputs``)."""

    reference: Callable[[], OutputsReader]
    """The reference's outputs, opened where an output is compacted (``reference_tensors.Reference.outputs_reader``)."""
    kl: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
    """KL per token of (reference rows, trial rows, ``task.top_k``, the output's elements): ``decisions.token_kl``, given
    by the trial's stage (the stages that only read outputs import no compare code)."""


def _against(kl_against: KlAgainst, names: list[str], first: dict[str, torch.Tensor], ids: list[str],
             path: Path) -> tuple[Callable, OutputsReader, list[str]] | None:
    """(KL's function, the reference's outputs, the compacted ``names`` whose KL is kept against them): those it stores
    full, of the same shape past dim 0 (a compact reference has no exact score to measure against: none)."""
    reference = kl_against.reference()
    if reference.ids is not None and reference.ids != ids:
        raise ValueError(f"{path}: the reference {reference.path} holds other cases than these outputs")
    names = [n for n in names if n in reference.names and n not in reference.compact
             and tuple(reference.shape(n)[1:]) == tuple(first[n].shape[1:])]
    return (kl_against.kl, reference, names) if names else None


def _encoding(first: dict[str, torch.Tensor], rest: Iterator[dict[str, torch.Tensor]], names: list[str], keep: int,
              against: tuple[Callable, OutputsReader, list[str]] | None, n_rows: int) -> Iterator[dict[str, torch.Tensor]]:
    """Each chunk with each of ``names`` replaced by its compact parts (``compact.encode``, ``keep`` best exact) and, for
    ``against``'s names, each token's KL (its function) against its reference's rows."""
    import torch

    row = 0
    for chunk in itertools.chain((first,), rest):
        out = {k: v for k, v in chunk.items() if k not in names}
        for name in names:
            scores = chunk[name].detach().to("cpu")
            if tuple(scores.shape[1:]) != tuple(first[name].shape[1:]) or scores.dtype != torch.float32:
                raise ValueError(f"write_outputs: output '{name}' changed dtype or shape between chunks")
            scores = scores.contiguous()
            for what, x in compact.encode(scores.numpy(), keep).items():
                out[compact.part(name, what)] = torch.from_numpy(x)
            if against is not None and name in against[2]:
                kl, reference = against[:2]
                ref = reference.read(name, row, row + scores.shape[0])
                out[compact.part(name, compact.KL)] = kl(ref, scores, keep, n_rows * math.prod(scores.shape[1:]))
        row += next(iter(chunk.values())).shape[0] if chunk else 0
        yield out


def _layout(first: dict[str, torch.Tensor], n_rows: int) -> dict[str, tuple[torch.dtype, list[int], int]]:
    """Name -> (dtype, shape past dim 0, bytes per row), in file order: larger items first, then by name."""
    import torch

    if not first:
        raise ValueError("write_outputs: the first chunk names no tensor")
    out = {}
    for name in sorted(first, key=lambda n: (-first[n].element_size(), n)):
        t = first[name]
        if _code(t.dtype) is None:
            raise ValueError(f"write_outputs: output '{name}' has dtype {t.dtype}, which safetensors cannot store here")
        if t.ndim == 0:
            raise ValueError(f"write_outputs: output '{name}' is a scalar; give one row per case")
        trailing = list(t.shape[1:])
        out[name] = (t.dtype, trailing, t.element_size() * int(torch.Size(trailing).numel()))
    return out


def _check_chunk(chunk: dict[str, torch.Tensor], layout: dict, path: Path) -> int:
    if set(chunk) != set(layout):
        raise ValueError(f"{path}: a chunk names {sorted(chunk)} but the first named {sorted(layout)}")
    rows = None
    for name, (dtype, trailing, _) in layout.items():
        t = chunk[name]
        if t.dtype != dtype or list(t.shape[1:]) != trailing:
            raise ValueError(
                f"{path}: output '{name}' is {t.dtype} {tuple(t.shape)} in a chunk, {dtype} [*, {trailing}] in the first"
            )
        if rows is None:
            rows = t.shape[0]
        elif t.shape[0] != rows:
            raise ValueError(f"{path}: the tensors of a chunk have different row counts")
    return int(rows or 0)


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in native (little-endian) order, without a copy when it is contiguous on CPU."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class OutputsReader:
    """Named per-case outputs of one safetensors file, read by slices of rows.

    ``expected_sha256`` (from a manifest) is checked before anything is read; ``produced_by`` names the
    stage to rerun in error messages.

    Raises:
        UserError: missing file, hash mismatch, or not a valid safetensors file (nothing is executed).
    """

    def __init__(self, path: str | Path, expected_sha256: str | None = None, produced_by: str = "") -> None:
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        hint = rerun(produced_by)
        if not self.path.is_file():
            raise UserError(f"{self.path} not found; run {hint} first")
        if expected_sha256 is not None:
            verify(self.path, expected_sha256, produced_by)
        try:
            with open(self.path, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                if size <= 0 or size > 100_000_000:
                    raise ValueError("bad header size")
                header = json.loads(handle.read(size))
            with safe_open(str(self.path), framework="pt"):  # validates header, offsets and size; reads no data
                pass
        except (SafetensorError, ValueError, OverflowError, UnicodeDecodeError, json.JSONDecodeError, OSError):
            raise UserError(
                f"{self.path} is not a valid safetensors file (truncated, or a pickle renamed?); "
                f"nothing was loaded: rebuild it with {hint}"
            ) from None
        self.meta = {k: from_jsonable(json.loads(v)) for k, v in (header.pop("__metadata__", None) or {}).items()}
        self._shapes = {name: tuple(entry["shape"]) for name, entry in header.items()}
        unknown = sorted(entry["dtype"] for entry in header.values() if entry["dtype"] not in _CODES.values())
        if unknown:
            raise UserError(
                f"{self.path} holds tensors of dtype {', '.join(unknown)}, which outputs are never written in; "
                f"rebuild it with {hint}"
            )
        self._dtypes = {name: _torch_dtype(entry["dtype"]) for name, entry in header.items()}
        self._offsets = {name: 8 + size + entry["data_offsets"][0] for name, entry in header.items()}
        self.compact: list[str] = [str(n) for n in self.meta.get("compact") or []]
        """Outputs stored compact (``artifacts.compact``): ``read`` decodes them, ``view`` gives None."""
        if self.compact and self.meta.get("compact_version") != compact.VERSION:
            raise UserError(_old_format(self.path, self.meta.get("compact_version"), produced_by))
        parts = {compact.part(n, w) for n in self.compact for w in compact.PARTS}
        if not parts <= set(self._shapes):
            raise UserError(f"{self.path} names compact outputs without their parts; rebuild it with {hint}")
        parts |= {compact.part(n, compact.KL) for n in self.compact} & set(self._shapes)
        self.names: list[str] = sorted([n for n in self._shapes if n not in parts] + self.compact)
        ids = self.meta.get("ids")
        self.ids: list[str] | None = [str(i) for i in ids] if isinstance(ids, list) else None
        row_counts = {s[0] if s else 0 for s in self._shapes.values()}
        if len(row_counts) > 1 or (self.ids is not None and row_counts and row_counts != {len(self.ids)}):
            raise UserError(
                f"{self.path} holds tensors of different row counts or ids that do not match them; rebuild it with {hint}"
            )
        self.rows: int = row_counts.pop() if row_counts else len(self.ids or [])
        self._mapped: mmap.mmap | None = None
        self._unmappable = False

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[compact.part(name, "codes") if name in self.compact else name]

    @property
    def store(self) -> str:
        """``compact`` when some output is stored compact, else ``full``."""
        return "compact" if self.compact else "full"

    def logit_error(self, name: str) -> float:
        """The largest error of a decoded finite score of ``name`` (``compact.logit_error``); 0.0 when stored full."""
        if name not in self.compact:
            return 0.0
        top, step = (self._read_raw(compact.part(name, w)).numpy() for w in ("top", "step"))
        return compact.logit_error(top, step)

    def kl(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor | None:
        """Each token's KL(reference || these) of rows ``start:stop`` of ``name`` (float64 [n, T]) as a compact trial
        keeps it (``compact.KL``); None where none is stored (a full output, or a compact reference's trial)."""
        part = compact.part(name, compact.KL)
        return self._read_raw(part, start, stop) if name in self.compact and part in self._shapes else None

    def kept(self, name: str) -> int | None:
        """The best classes of each row of ``name`` kept exactly (``compact.encode``); None when stored full (all)."""
        return self._shapes[compact.part(name, "best")][-1] if name in self.compact else None

    def check_top_k(self, name: str, k: int) -> None:
        """Raises: UserError when ``name`` is stored compact with fewer than ``k`` best classes kept exactly (top-k of a
        larger k could re-rank a target within half a quantum of its neighbour)."""
        kept = self.kept(name)
        if kept is not None and kept < min(k, self.shape(name)[-1]):
            raise UserError(f"{self.path} keeps the {kept} best scores of a token exactly (compare.store compact) but "
                            f"task.top_k is {k}; rebuild it with `dvc repro --force` under this task.top_k")

    def read(self, name: str, start: int = 0, stop: int | None = None, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of output ``name``: a new CPU tensor of the stored dtype, or a view of the front
        of ``buffer`` (contiguous, that dtype, large enough; reused chunk after chunk, so that no new memory
        is touched per chunk: a fresh chunk costs a page fault every 4 KiB). A compact output is decoded
        (float32; ``buffer`` unused)."""
        import torch

        if name in self.compact:
            parts = {w: self._read_raw(compact.part(name, w), start, stop).numpy() for w in compact.PARTS}
            return torch.from_numpy(compact.decode(parts))
        return self._read_raw(name, start, stop, buffer)

    def _read_raw(self, name: str, start: int = 0, stop: int | None = None, buffer: torch.Tensor | None = None):
        """``read`` of a tensor as stored in the file."""
        import torch

        stop = self.rows if stop is None else min(stop, self.rows)
        start = min(max(start, 0), stop)
        shape, dtype = self._shapes[name], self._dtypes[name]
        row_elems, item = self._row(name)
        count = (stop - start) * row_elems
        if buffer is not None and buffer.dtype == dtype and buffer.is_contiguous() and buffer.numel() >= count:
            out = buffer.reshape(-1)[:count].view(stop - start, *shape[1:])
        else:
            out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        nbytes = (stop - start) * row_elems * item
        if nbytes:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            with open(self.path, "rb", buffering=0) as handle:
                handle.seek(self._offsets[name] + start * row_elems * item)
                got = 0
                while got < nbytes:
                    n = handle.readinto(view[got:])
                    if not n:
                        raise UserError(f"{self.path} is truncated; rebuild it with `dvc repro --force`")
                    got += n
        return out

    def view(self, name: str, start: int, stop: int) -> torch.Tensor | None:
        """Rows ``start:stop`` of output ``name`` as a view of the file mapped in memory: no copy, the pages
        read in ahead with one ``madvise``; None where the file cannot be mapped (then ``read``).

        Never write into it. Mapped pages count in the process's resident memory until ``release`` drops
        them: call it once the rows are used, so that memory stays one chunk, not the file.
        """
        import torch

        stop = min(stop, self.rows)
        start = min(max(start, 0), stop)
        mapped = self._mapping() if name not in self.compact else None
        if mapped is None:
            return None
        shape, dtype = self._shapes[name], self._dtypes[name]
        row_elems, item = self._row(name)
        count, offset = (stop - start) * row_elems, self._offsets[name] + start * row_elems * item
        if count == 0:
            return torch.empty((0, *shape[1:]), dtype=dtype)
        self._advise(_MADV_POPULATE_READ, offset, count * item)
        with warnings.catch_warnings():  # a private (copy-on-write) mapping is writable, so none is expected
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset)
        return flat.view(stop - start, *shape[1:])

    def release(self, name: str, start: int, stop: int) -> None:
        """Drop the mapped pages of rows ``start:stop`` of ``name`` from resident memory (``view``)."""
        if self._mapped is None:
            return
        row_elems, item = self._row(name)
        nbytes = row_elems * item
        self._advise(mmap.MADV_DONTNEED, self._offsets[name] + start * nbytes, (stop - start) * nbytes)

    def _mapping(self):
        if self._mapped is None and not self._unmappable:
            try:
                if not hasattr(mmap, "MADV_DONTNEED"):
                    raise OSError("no madvise: the pages could not be released")
                with open(self.path, "rb") as handle:
                    self._mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):
                self._unmappable = True
        return self._mapped

    def _advise(self, advice: int, offset: int, nbytes: int) -> None:
        """madvise on the whole pages covering [offset, offset + nbytes); advice the kernel lacks is skipped."""
        first = offset - offset % mmap.PAGESIZE
        end = min(offset + nbytes, len(self._mapped))
        if end > first:
            try:
                self._mapped.madvise(advice, first, end - first)
            except (OSError, ValueError):
                pass

    def chunks(self, size: int) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        """(start, stop, {name: rows start:stop}) for consecutive slices of ``size`` rows."""
        if size <= 0:
            raise ValueError(f"chunk size must be positive, got {size}")
        for start in range(0, self.rows, size):
            stop = min(start + size, self.rows)
            yield start, stop, {name: self.read(name, start, stop) for name in self.names}

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every output whole: for small sets only."""
        return {name: self.read(name) for name in self.names}

    def row_bytes(self) -> int:
        """Bytes of one row of every output together (to size chunks by memory)."""
        return sum(math.prod(self._row(name)) for name in self._shapes)

    def _row(self, name: str) -> tuple[int, int]:
        """Elements in one row of output ``name``, and bytes per element."""
        import torch

        return int(torch.Size(self._shapes[name][1:]).numel()), torch.empty(0, dtype=self._dtypes[name]).element_size()


def _old_format(path: Path, version, produced_by: str) -> str:
    return (f"{path} holds compact outputs of another compact format (version {version or 1}, this version reads "
            f"{compact.VERSION}, which keeps a trial's KL per token exactly); rerun {produced_by or 'the stage that wrote it'}: "
            f"{rerun(produced_by)}")


class NumpyReader:
    """Named per-case outputs of one safetensors file as numpy arrays (safetensors' numpy loader: no torch),
    sha256 verified once, read whole or by a set of rows.

    Raises:
        UserError: missing file, or a hash that differs from ``expected_sha256``.
    """

    def __init__(self, path: str | Path, expected_sha256: str, produced_by: str) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        verify(self.path, expected_sha256, produced_by)
        with safe_open(str(self.path), framework="np") as handle:
            meta = handle.metadata() or {}
            self.ids: list[str] = json.loads(meta.get("ids", "[]"))
            self.compact: list[str] = json.loads(meta.get("compact", "[]"))
            version = json.loads(meta.get("compact_version", "null"))
            shapes = {name: handle.get_slice(name).get_shape() for name in handle.keys()}
        if self.compact and version != compact.VERSION:
            raise UserError(_old_format(self.path, version, produced_by))
        parts = {compact.part(n, w) for n in self.compact for w in (*compact.PARTS, compact.KL)}
        shapes |= {n: shapes[compact.part(n, "codes")] for n in self.compact}
        self.elements_per_case = sum(math.prod(s[1:]) for name, s in shapes.items() if name not in parts)
        """Output elements in one case, summed over the named outputs (a compact one counted decoded)."""

    def read(self, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Every named output, all rows or only ``rows`` (sorted; read by runs of consecutive rows, never the whole file)."""
        import numpy as np
        from safetensors import safe_open

        with safe_open(str(self.path), framework="np") as handle:
            if rows is None:
                out = {name: handle.get_tensor(name) for name in handle.keys()}
            else:
                runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
                out = {}
                for name in handle.keys():
                    view = handle.get_slice(name)
                    out[name] = np.concatenate([view[int(r[0]) : int(r[-1]) + 1] for r in runs])
        for name in self.compact:  # decoded: the reader sees scores, whichever store wrote them
            out[name] = compact.decode({w: out.pop(compact.part(name, w)) for w in compact.PARTS})
            out.pop(compact.part(name, compact.KL), None)
        return out
