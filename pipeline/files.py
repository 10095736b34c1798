"""Writing and reading stage outputs: atomic, deterministic, hashed.

Every file a stage produces goes through ``write_bytes`` (temporary file in the same folder, fsync,
rename), so a killed stage leaves the old file or none, never half a file. A folder of several files is
replaced as a whole (``StagedFolder``): the new set is written beside the old one, then switched with two
renames, so a stage that fails half-way (a full disk, a kill) leaves the previous set, never a mix. JSON is
written with sorted keys and full-precision floats so that reruns on the same machine give identical bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from collections.abc import Callable, Collection, Mapping
from typing import Any, BinaryIO, Iterator

from pipeline.errors import UserError


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary handle whose content replaces ``path`` atomically when the block ends without error.

    The bytes go to a temporary file in the same folder, then fsync, rename, and an fsync of the folder:
    a killed stage leaves the old file or none, never half a file. The file gets the mode a plain
    ``open(path, "wb")`` would give: ``mkstemp`` creates it ``-rw-------``, while a DVC cache or workspace
    shared by a team, or written in a container under another uid, must stay readable by the others, so
    it gets 0666 minus the process umask (0644 under the usual 022) before it takes ``path``'s place.

    Raises:
        UserError: the folder cannot be created or written.
    """
    path = Path(path)
    check_inside_repository(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}; make its folder writable") from None
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a full filesystem (or a user's exhausted quota)."""


class DiskFull(UserError):
    """A stage's outputs did not fit on their filesystem; the previous ones were left in place."""


def disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL


def no_space(folder: str | Path, needed: str = "") -> str:
    """The one line for a full filesystem under ``folder``: its free space now and, when known, what the stage needs."""
    folder = Path(folder)
    probe = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    free = size_text(shutil.disk_usage(probe).free)
    return (f"no space left on {folder}'s filesystem ({free} free{', ' + needed if needed else ''}): "
            f"free space or move data/ (the previous outputs are intact)")


def size_text(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) if folder.is_dir() else 0


class StagedFolder:
    """The next content of the folder ``folder``, written into ``.NAME.pending`` beside it (same filesystem), then put
    in its place all at once: the old folder is renamed ``.NAME.old``, the new one takes its name, the old one goes.

    Used as ``with StagedFolder(folder) as new:`` (``new``: the pending folder to write into), it switches when the
    block ends without error; on any error the pending folder goes and ``folder`` is left as it was. An owner that
    writes across several calls (``trial_tensors.Writer``) keeps the object and enters it around its last writes.
    A crash between the two renames is undone when the next one starts (``recover``): the old folder comes back.
    ``owned``: the files the stage writes (relative paths, or a test of a relative path); any other file of the old
    folder (DVC's ``.gitignore`` in a folder whose outputs are files, a user's note) is carried into the new set (a hard
    link: no space taken). None: the stage owns the whole folder.

    Raises:
        DiskFull: the filesystem filled up (ENOSPC, EDQUOT): one line with the free space and what is needed.
        UserError: the folder is a symlink, a file or outside the repository, or its parent cannot be written.
    """

    def __init__(self, folder: str | Path, owned: Collection[str] | Callable[[Path], bool] | None = None) -> None:
        self.folder = Path(folder)
        check_inside_repository(self.folder)
        self.path = self.folder.with_name(f".{self.folder.name}.pending")
        recover(self.folder)
        if self.folder.exists() and not self.folder.is_dir():  # someone's file where the outputs go: never replaced
            raise UserError(f"cannot write {self.folder}: a file is there, not a folder; move it away (the stage's "
                            f"outputs go there), then rerun")
        try:
            shutil.rmtree(self.path, ignore_errors=True)  # what a killed run left
            self.path.mkdir(parents=True)
            if owned is not None:
                _carry(self.folder, self.path, owned)
        except OSError as exc:
            shutil.rmtree(self.path, ignore_errors=True)
            if exc.errno in FULL:
                raise DiskFull(no_space(self.folder)) from None
            raise UserError(f"cannot write {self.path}: {exc.strerror}; make its folder writable") from None

    def __enter__(self) -> Path:
        _ENTERED.append(self)
        return self.path

    def __exit__(self, typ, exc, tb) -> None:
        if _ENTERED and _ENTERED[-1] is self:
            _ENTERED.pop()
        if exc is None:
            try:
                self.commit()
            except BaseException as failed:
                self.discard(failed)
                raise
        else:
            self.discard(exc)

    def commit(self) -> None:
        """Put the pending folder in place of ``folder`` (two renames), then remove the old one."""
        old = _old(self.folder)
        if self.folder.exists():
            os.rename(self.folder, old)
        os.rename(self.path, self.folder)
        _fsync_folder(self.folder.parent)
        shutil.rmtree(old, ignore_errors=True)

    def discard(self, exc: BaseException | None = None) -> None:
        """Remove the pending folder, ``folder`` untouched; a full filesystem (``exc``) becomes one line (``DiskFull``),
        said by the outermost staged folder of the block (report's two: a write to either fills the one filesystem),
        with the sizes of every folder it encloses.

        Raises:
            DiskFull: ``exc`` is ENOSPC or EDQUOT, and no staged folder encloses this one.
        """
        written = folder_size(self.path)
        shutil.rmtree(self.path, ignore_errors=True)
        if disk_full(exc):
            inner_written, inner_previous = getattr(exc, "staged_sizes", (0, 0))
            written, previous = written + inner_written, folder_size(self.folder) + inner_previous
            if _ENTERED:  # an enclosing folder's block discards its own new set, then says it once
                exc.staged_sizes = (written, previous)
                return
            needed = (f"about {size_text(previous)} needed, the size of the previous outputs" if previous >= written else
                      f"at least {size_text(written)} needed, what was written before it filled")
            raise DiskFull(no_space(self.folder, needed)) from None


_ENTERED: list[StagedFolder] = []
"""The staged folders whose ``with`` block is running, outermost first."""


def _carry(folder: Path, new: Path, owned: Collection[str] | Callable[[Path], bool]) -> None:
    """Link (or copy, across filesystems) each file of ``folder`` that is not ``owned`` into ``new``, at its place."""
    if not folder.is_dir():
        return
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_dir() or (owned(rel) if callable(owned) else rel.as_posix() in owned):
            continue
        (new / rel).parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            os.symlink(os.readlink(path), new / rel)
            continue
        try:
            os.link(path, new / rel)
        except OSError:
            shutil.copy2(path, new / rel)


class StagedFile:
    """The next content of one file ``path`` outside a staged folder (a DVC metric in the shared ``data/metrics``),
    written as ``.NAME.pending`` beside it and put in its place when the block ends without error; on any error the
    pending file goes, ``path`` is left as it was and the error goes on unchanged. Nested inside a ``StagedFolder``'s
    block, which turns a full disk into its one line (naming the stage's folder), the folder and this file are switched
    together, after every write succeeded (a file's switch is one rename).

    Raises:
        DiskFull: the switch itself met a full filesystem (ENOSPC, EDQUOT).
    """

    def __init__(self, path: str | Path) -> None:
        self.target = Path(path)
        check_inside_repository(self.target.parent)
        self.path = self.target.with_name(f".{self.target.name}.pending")

    def __enter__(self) -> Path:
        self.path.unlink(missing_ok=True)  # what a killed run left
        return self.path

    def __exit__(self, typ, exc, tb) -> None:
        if exc is not None:
            self.path.unlink(missing_ok=True)
            return
        try:
            os.replace(self.path, self.target)
            _fsync_folder(self.target.parent)
        except OSError as failed:
            self.path.unlink(missing_ok=True)
            if disk_full(failed):
                raise DiskFull(no_space(self.target.parent)) from None
            raise


def _old(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.old")


def recover(folder: str | Path) -> None:
    """Undo a switch that stopped between its two renames (``StagedFolder.commit``): ``folder`` missing and
    ``.NAME.old`` there puts the old folder back; both there, the old one is a leftover and goes."""
    folder = Path(folder)
    old = _old(folder)
    if not old.is_dir():
        return
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(old, folder)


def _fsync_folder(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def check_inside_repository(folder: str | Path) -> None:
    """Refuse to write or delete under ``folder`` when it, or a folder between it and the repository root
    (the working directory the stages run in), is a symlink, or when it resolves outside the repository.

    Only relative paths are checked: they are the stages' outputs (``pipeline.paths``); an absolute path
    is a caller's own choice (a temporary folder, a test).

    Raises:
        UserError: the folder is, or lies under, a symlink, or resolves outside the repository.
    """
    folder = Path(folder)
    if folder.is_absolute():
        return
    root = Path.cwd().resolve()
    step = Path()
    for part in folder.parts:
        step = step / part
        if part == "..":
            break
        if step.is_symlink():
            raise UserError(
                f"{step} is a symlink (to {os.readlink(step)}); a stage never writes or deletes through one: replace it "
                f"with a real folder inside the repository (`rm {step}`), then rerun"
            )
    if not folder.resolve().is_relative_to(root):
        raise UserError(
            f"{folder} resolves to {folder.resolve()}, outside the repository {root}; keep the outputs inside it, then rerun"
        )


def write_bytes(path: str | Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (see ``atomic_file``)."""
    with atomic_file(path) as handle:
        handle.write(data)


def current_umask() -> int:
    """The process umask, read without changing it where Linux reports it (``os.umask`` can only swap it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def to_jsonable(value: Any) -> Any:
    """Plain JSON types; non-finite floats become the strings 'nan', 'inf', '-inf'."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty mappings stay values.

    The one flat view of a nested record: params as MLflow params, stats.json as the report's rows.
    """
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def dumps(value: Any) -> str:
    return json.dumps(to_jsonable(value), sort_keys=True, indent=2, allow_nan=False) + "\n"


def write_json(path: str | Path, value: Any) -> None:
    write_bytes(path, dumps(value).encode())


def read_json(path: str | Path, produced_by: str = "", expected_sha256: str | None = None) -> Any:
    """Read a JSON output of an earlier stage, checked against the sha256 its manifest records when one is given.

    Raises:
        UserError: the file is missing, differs from its manifest (``verify``) or is not valid JSON.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(_not_found(path, produced_by)) from None
    if expected_sha256 is not None:
        verify(path, expected_sha256, produced_by, actual=hashlib.sha256(data).hexdigest())
    try:
        return from_jsonable(json.loads(data))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON (damaged?); rebuild it with {rerun(produced_by)}") from None


def rerun(produced_by: str) -> str:
    """The command that rebuilds a stage's output, as error messages name it."""
    return f"`dvc repro {produced_by}`" if produced_by else "`dvc repro --force`"


def _not_found(path: Path, produced_by: str) -> str:
    return f"{path} not found; run {rerun(produced_by or producer(path))} first"


def missing_input(exc: FileNotFoundError) -> str | None:
    """The one line for a stage run before the stage that writes the file it did not find (``exc.filename``), naming
    that stage (``producer``): ``python -m pipeline freeze`` before ``prepare``. None for a file no stage writes (a
    bug, or the user's own file: its traceback is kept)."""
    stage = producer(exc.filename) if isinstance(exc.filename, (str, os.PathLike)) else ""
    return _not_found(Path(exc.filename), stage) if stage else None


def producer(path: str | Path) -> str:
    """The stage that writes ``path``, as ``dvc repro`` names it (``prepare``, ``trial@float16``), from the table of
    output paths (``pipeline.paths``); '' for a path no stage writes (``data/resume``, a user's file)."""
    from pipeline import paths

    path = Path(path)
    if path.is_absolute():
        if not path.is_relative_to(Path.cwd()):
            return ""
        path = path.relative_to(Path.cwd())
    for folder, stage in ((paths.PREPARED, "prepare"), (paths.REFERENCE, "freeze"), (paths.REPORT, "report")):
        if path.is_relative_to(folder):
            return stage
    for folder_of, stage in ((paths.trial, "trial"), (paths.compare, "compare"), (paths.diagnose, "diagnose"),
                             (paths.decision, "decide"), (paths.benchmark, "benchmark")):
        root = folder_of("-").parent
        if path.is_relative_to(root) and path != root:
            return f"{stage}@{path.relative_to(root).parts[0]}"
    if path.parent == paths.METRICS and path.suffix == ".json":  # paths.decision_metrics, benchmark_metrics, compare_metrics
        for prefix, stage in (("bench-", "benchmark"), ("compare-", "compare"), ("", "decide")):
            if path.stem.startswith(prefix):
                return f"{stage}@{path.stem[len(prefix):]}"
    return ""


def verify(
    path: str | Path, expected_sha256: str, produced_by: str = "", recorded_in: str = "its manifest", actual: str | None = None
) -> None:
    """Check a file against the sha256 recorded when it was written (``recorded_in``: its manifest, the rollback
    package): the one check, with the one message, for every artifact read back. ``actual``: the sha256 of the
    bytes the caller already read (the file is not read again).

    Raises:
        UserError: the file is missing, or its sha256 differs from the recorded one.
    """
    path = Path(path)
    if actual is None:
        if not path.is_file():
            raise UserError(_not_found(path, produced_by))
        actual = sha256_file(path)
    if actual != expected_sha256:
        raise UserError(
            f"{path} differs from {recorded_in} (sha256 {actual[:12]}…, recorded {expected_sha256[:12]}…): "
            f"it was damaged or replaced; restore it with `dvc checkout` or rebuild it with {rerun(produced_by)}"
        )


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def from_jsonable(value: Any) -> Any:
    """Inverse of ``to_jsonable``: the strings 'nan', 'inf', '-inf' become floats again."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    return value


def write_tensors(path: str | Path, tensors: dict[str, Any], meta: dict[str, Any] | None = None) -> str:
    """Write a safetensors file (header keys sorted, metadata as JSON strings); return its sha256."""
    from safetensors.torch import save

    metadata = {k: json.dumps(to_jsonable(v), sort_keys=True) for k, v in (meta or {}).items()}
    raw = save(tensors, metadata=metadata)
    # safetensors writes its header from a hash map, whose order changes from one process to the next;
    # re-serialise it with sorted keys (same offsets, same data) so equal content gives equal bytes.
    size = int.from_bytes(raw[:8], "little")
    header = json.dumps(json.loads(raw[8 : 8 + size]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    write_bytes(path, len(header).to_bytes(8, "little") + header + raw[8 + size :])
    return sha256_file(path)


def read_tensors(path: str | Path, expected_sha256: str | None = None, produced_by: str = "") -> tuple[dict, dict]:
    """Read a safetensors file written by ``write_tensors``, verifying its hash first when one is expected.

    Raises:
        UserError: missing file, hash mismatch, or not a valid safetensors file (nothing is executed).
    """
    tensors, meta, _ = read_tensors_hashed(path, expected_sha256, produced_by)
    return tensors, meta


def read_tensors_hashed(path: str | Path, expected_sha256: str | None = None, produced_by: str = "") -> tuple[dict, dict, str]:
    """The tensors, the metadata and the sha256 of a safetensors file, from one read of it (verified when
    ``expected_sha256`` is given).

    Raises:
        UserError: missing file, hash mismatch, or not a valid safetensors file (nothing is executed).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(_not_found(path, produced_by))
    raw = path.read_bytes()
    actual = hashlib.sha256(raw).hexdigest()
    if expected_sha256 is not None:
        verify(path, expected_sha256, produced_by, actual=actual)
    tensors, meta = _parse_tensors(path, raw, rerun(produced_by))
    return tensors, meta, actual


def _parse_tensors(path: Path, raw: bytes, hint: str) -> tuple[dict, dict]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(raw)
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + header_len])
        meta = {k: from_jsonable(json.loads(v)) for k, v in (header.get("__metadata__") or {}).items()}
    except (SafetensorError, ValueError, OverflowError, UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(
            f"{path} is not a valid safetensors file (truncated, or a pickle renamed?); "
            f"nothing was loaded: rebuild it with {hint}"
        ) from None
    return tensors, meta
