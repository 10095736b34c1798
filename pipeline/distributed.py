"""Data-parallel freeze, trials and benchmarks inside a rank (params ``distributed.nproc_per_node`` or ``nnodes`` > 1).

pipeline/launch.py starts the ranks (torchrun); this module is each rank's side and imports neither torch
nor pipeline.devices at the top. Each rank joins one process group (``init``): gloo on the CPU, NCCL on
CUDA (on ROCm, torch's ``nccl`` backend is RCCL), one GPU per rank (``cuda:LOCAL_RANK``). With N == 1
nothing here runs: no process group, no wrapper, the single-process bytes. Across nodes (``nnodes`` > 1) the ranks
are the world's (torchrun's rendezvous numbers them), and rank 0 of the world alone writes: only the world size
changes the bytes.

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
Inference on the fixed set runs on rank 0 only. The other ranks train and exit.

benchmark@DTYPE on N ranks times one global update (every rank its slice, DDP's all-reduce included) on
rank 0's clock. On a GPU its memory probes run rank 0's slice of the batch in one process of their own (no
process group, so no DDP gradient buckets: ``shard_only``); on the CPU every rank measures in its own
process, DDP included, and rank 0 records its figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

from pipeline.errors import UserError


def in_torchrun() -> bool:
    """This process is one of torchrun's ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


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
                f"training set is smaller than reference.batch_size); use a batch_size and a training set size divisible by "
                f"{self.size}"
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
