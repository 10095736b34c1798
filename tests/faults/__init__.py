"""Fault injection for the tests that stop a real stage process mid-run.

The pipeline reads no fault variable: ``training.train`` takes an ``on_step`` hook, and every output file is written
through ``files.atomic_file``. A stage run with the
environment of ``after_step`` finds this folder first on its path, so Python imports this folder's
``sitecustomize`` when it starts, in every process (torchrun's ranks included); that module hands every
``train`` call the hook that stops the process. ``disk_full`` likewise makes ``atomic_file``'s handles fail with
ENOSPC after a number of bytes, as a small filesystem would.
"""

from __future__ import annotations

import os
from pathlib import Path


def after_step(env: dict[str, str], step: int, stop: bool = False, rank: int | None = None) -> dict[str, str]:
    """``env`` for a stage that kills itself with SIGKILL (``stop``: freezes itself with SIGSTOP, for a kill
    from outside) after step ``step`` of its trainings counted one after the other (freeze: the reference's
    steps 1..S, then the FP32 replicate's S+1..2S). Under torchrun, rank ``rank`` only (default: every rank)."""
    out = dict(env, PIPELINE_FAULT_AFTER_STEP=str(step), PIPELINE_FAULT_SIGNAL="SIGSTOP" if stop else "SIGKILL")
    if rank is not None:
        out["PIPELINE_FAULT_RANK"] = str(rank)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p)
    return out


def disk_full(env: dict[str, str], after_bytes: int, folder: str = "data") -> dict[str, str]:
    """``env`` for a stage whose filesystem fills up: its writes to the files under ``folder`` (a path from the repository
    root), and under the new set it stages beside it (``.NAME.pending``), raise ``OSError(ENOSPC)`` once it has written
    ``after_bytes`` bytes there."""
    path = Path(folder)
    under = os.pathsep.join((folder, str(path.with_name(f".{path.name}.pending"))))
    out = dict(env, PIPELINE_FAULT_ENOSPC_AFTER_BYTES=str(after_bytes), PIPELINE_FAULT_ENOSPC_UNDER=under)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p)
    return out


def flip_exponent_bit(path: Path, name: str = "model/0.weight") -> None:
    """Damage on disk: the lowest exponent bit of tensor ``name``'s first float32 in the safetensors file ``path``
    (the value doubles or halves; the file still parses)."""
    import json

    raw = bytearray(path.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    start = 8 + size + header[name]["data_offsets"][0]
    raw[start + 2] ^= 0x80  # bit 23 of the first float32
    path.write_bytes(bytes(raw))
