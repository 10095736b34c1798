"""Data-parallel freeze, trials and benchmarks under torchrun (params ``distributed.nproc_per_node`` > 1).

With ``nproc_per_node: N`` > 1, ``python -m pipeline freeze|trial|benchmark`` starts itself again as
``python -m torch.distributed.run --standalone --nproc_per_node N -m pipeline ...`` (``relaunch``): the
dvc.yaml command stays the same. Each rank joins one process group (``init``): gloo on the CPU, NCCL on
CUDA (on ROCm, torch's ``nccl`` backend is RCCL), one GPU per rank (``cuda:LOCAL_RANK``). With N == 1
nothing here runs: no process group, no wrapper, the single-process bytes.

How the fixed batch order is split (``World.shard``): the seeded order of global micro-batches is the
single-process one (``training.update_batches``); rank r takes the r-th of N contiguous equal slices of
every micro-batch's indices. The global batch stays ``reference.batch_size``; each rank computes the mean
loss of batch_size/N rows, and DistributedDataParallel averages the gradients over the ranks, so an
update is that of the mean loss over the global batch (exactly, up to rounding, when every row weighs the
same; with per-token targets of -100 it is the mean of the ranks' per-token means). A batch_size that N
does not divide is refused. The recorded loss is the mean over ranks; the gradient norm, the GradScaler's
scale and its skip decision are the same on every rank, since gradients are all-reduced before
``unscale_`` looks for inf/NaN. Dropout draws from the same seeded RNG stream on every rank. BatchNorm
statistics are per rank (DDP broadcasts rank 0's buffers at each forward; no SyncBatchNorm).

Rank 0 alone writes: every output (atomically, as in one process), the resume state, the lines printed.
Inference on the fixed set runs on rank 0 only. The other ranks train and exit. A rank that dies
takes the group down (torchrun stops the others), nothing is written, and the parent prints one line and
exits 2; rerunning resumes from rank 0's last saved state (``reference.checkpoint_every``).

benchmark@DTYPE on N ranks times one global update (every rank its slice, DDP's all-reduce included) on
rank 0's clock. On a GPU its memory probes run rank 0's slice of the batch in one process of their own (no
process group, so no DDP gradient buckets: ``shard_only``); on the CPU every rank measures in its own
process, DDP included, and rank 0 records its figures.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterable

from pipeline.errors import UserError

RELAUNCHED = ("freeze", "trial", "benchmark")
"""Stages that train and therefore run on N ranks; the others are single-process."""


def in_torchrun() -> bool:
    """This process is one of torchrun's ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def check_launch(params, visible_gpus: int | None) -> None:
    """Refuse, in one line, what N ranks cannot run. ``visible_gpus`` is None when the run is on the CPU."""
    n = params.distributed.nproc_per_node
    batch = params.reference.batch_size
    if batch % n:
        raise UserError(
            f"params.yaml: distributed.nproc_per_node {n} does not divide reference.batch_size {batch} (each rank takes "
            f"batch_size/N rows of every micro-batch); use a batch_size that is a multiple of {n}"
        )
    if visible_gpus is not None and n > visible_gpus:
        raise UserError(
            f"params.yaml: distributed.nproc_per_node is {n} but {visible_gpus} GPU(s) are visible here (one rank per GPU); "
            f"set nproc_per_node to at most {visible_gpus}, or make more GPUs visible (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)"
        )


def relaunch(stage: str, params, argv: list[str]) -> int | None:
    """Run ``python -m pipeline ARGV`` on N ranks under torchrun and return its exit status; None when this
    process should run the stage itself (N == 1, a single-process stage, or already a rank).

    Raises:
        UserError: N ranks cannot run here, or a rank failed (its own one-line error, or how it died).
    """
    n = params.distributed.nproc_per_node
    if n <= 1 or stage not in RELAUNCHED or in_torchrun():
        return None
    from pipeline import devices  # imports torch: only a distributed run pays for it here

    device = devices.resolve(params.device)
    import torch

    check_launch(params, torch.cuda.device_count() if device.type == "cuda" else None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m", "pipeline", *argv]
    proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, errors="replace")
    if proc.returncode != 0:
        line = failure_line(proc.stderr, n, " ".join(argv))
        if "(exit 1)" in line:  # a rank crashed on a bug (an uncaught exception): its traceback is kept
            sys.stderr.write(proc.stderr)
        raise UserError(line)
    sys.stderr.write(proc.stderr)
    return 0


_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)


def failure_line(stderr: str, n: int, what: str) -> str:
    """The one line for a failed torchrun: a rank's own ``error:`` line when it printed one, else which rank
    died and how (torchrun's "Root Cause" report), else torchrun's last line."""
    for line in stderr.splitlines():
        if line.startswith("error: "):
            return line[len("error: ") :]
    cause = stderr[stderr.rfind("Root Cause") :] if "Root Cause" in stderr else stderr  # not the ranks torchrun stopped
    rank, code = _RANK.search(cause), _EXIT.search(cause)
    if rank and code:
        status = int(code.group(1))
        how = f"killed by {signal.Signals(-status).name}" if status < 0 and -status in signal.Signals._value2member_map_ else f"exit {status}"
        died = f"rank {rank.group(1)} of {n} died ({how})"
    else:
        last = [line for line in stderr.splitlines() if line.strip()]
        died = f"torchrun failed ({last[-1].strip()[:200] if last else 'no message'})"
    return (
        f"`python -m pipeline {what}` on {n} ranks: {died}; nothing was written (rank 0 writes only at the end): "
        f"rerun it to resume from the last saved step"
    )


# --- inside a rank ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """This process's place in the process group; the default is the single process (nothing changes)."""

    rank: int = 0
    size: int = 1
    backend: str | None = None

    @property
    def writes(self) -> bool:
        """Only rank 0 writes outputs, resume states and lines."""
        return self.rank == 0

    def shard(self, idx):
        """This rank's contiguous slice of one global micro-batch's row indices.

        Raises:
            UserError: the micro-batch (batch_size, or the whole training set when it is smaller) does not
                split into ``size`` equal slices.
        """
        if self.size == 1:
            return idx
        if len(idx) % self.size:
            raise UserError(
                f"a micro-batch of {len(idx)} rows does not split over distributed.nproc_per_node {self.size} ranks (the "
                f"training set is smaller than reference.batch_size); use a batch_size and a training set size divisible by {self.size}"
            )
        per = len(idx) // self.size
        return idx[self.rank * per : (self.rank + 1) * per]

    def wrap(self, model, device):
        """The module the training steps call: ``model`` itself, or DistributedDataParallel around it."""
        if self.size == 1 or self.backend is None:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)  # every parameter must take part in the loss

    def mean(self, value):
        """The mean of a scalar tensor over the ranks (the recorded loss)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        value = value.detach().clone()
        dist.all_reduce(value)
        return value / self.size

    def key(self, run_key: str) -> str:
        """A resume key: a state saved by another world size is another run's."""
        return run_key if self.size == 1 else f"{run_key}/world{self.size}"

    def describe(self) -> dict[str, Any]:
        """What the manifests record (nothing for a plain process: its manifests stay as they were)."""
        return {} if self.backend is None else {"world_size": self.size, "process_group_backend": self.backend}


_WORLD = [World()]


def current() -> World:
    return _WORLD[0]


def init(device):
    """Join torchrun's process group when this process is one of its ranks; return the rank's device
    (``cuda:LOCAL_RANK`` on GPUs). A plain process: the device as given, nothing started. Under torchrun
    with one rank (``torchrun --nproc_per_node 1 -m pipeline ...`` by hand, to check that NCCL starts) the
    group is made and recorded, but nothing is wrapped or split."""
    if not in_torchrun():
        return device
    import atexit

    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        atexit.register(dist.destroy_process_group)
    _WORLD[0] = World(rank=dist.get_rank(), size=dist.get_world_size(), backend=backend)
    return device


def shard_only() -> None:
    """In a process torchrun's rank started on its own (the benchmark's memory probe): take the rank's slice
    of every batch, in this process alone (no process group: no DDP, no all-reduce)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        _WORLD[0] = World(rank=int(os.environ.get("RANK", "0")), size=size, backend=None)


def discard(name: str, chunks: Iterable) -> None:
    """The output sink of ranks other than 0: the chunks are never computed (inference is rank 0's)."""
