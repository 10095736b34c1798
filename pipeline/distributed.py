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

With ``distributed.strategy: fsdp`` (FSDP2), the training loop trains a copy of the model sharded by ``fully_shard``
(``World.sharded_copy``): each block (a module of a class named in ``distributed.fsdp_blocks``, else each top-level
child with parameters), then the root, holds 1/N of its parameters, gradients and optimizer state on each rank; the
gradients of the mean loss are reduce-scattered (averaged) over the ranks, as DDP's all-reduce averages them. The
model the caller holds stays whole: at each resume point and at the end, the full state is gathered to rank 0
(``full_state``: torch.distributed.checkpoint.state_dict, ``full_state_dict``) in the very format one process writes
(optimizer state numbered by parameter, as ``Optimizer.state_dict`` numbers it), the trained weights are loaded into
that model on rank 0, which infers and writes as under DDP. A resume state goes back into the shards on every rank
(``load_full_state``). The GradScaler's skip decision is the same on every rank: its inf/NaN flag is all-reduced
(``agree_found_inf``). Memory: the caller's whole FP32 model stays on every rank beside the shards (4 bytes a
parameter; the training state, 16 with AdamW, is the sharded part), in host memory while the shards train.

benchmark@DTYPE on N ranks times one global update (every rank its slice, DDP's all-reduce included) on
rank 0's clock. On a GPU its memory probes run rank 0's slice of the batch in one process of their own (no
process group, so no DDP gradient buckets: ``shard_only``); on the CPU every rank measures in its own
process, DDP included, and rank 0 records its figures. Under FSDP2 every arm trains a sharded copy, as the trials
do (``sharded_copy``, FSDP2's mixed precision included; the whole model is not kept beside it), and the memory is
measured in every rank's process on a GPU too: a probe's process has no group to shard in.
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
    strategy: str = "ddp"
    """``ddp`` or ``fsdp`` (params ``distributed.strategy``)."""
    blocks: tuple[str, ...] = ()
    """FSDP2's block classes (params ``distributed.fsdp_blocks``)."""

    @property
    def sharded(self) -> bool:
        """FSDP2 trains here: strategy fsdp in a process group (one rank too, under torchrun by hand: a one-GPU check)."""
        return self.strategy == "fsdp" and self.backend is not None

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
        """A resume key: a state saved by another world size, or under FSDP2 (other reductions), is another run's."""
        if self.size == 1 and not self.sharded:
            return run_key
        return f"{run_key}/world{self.size}" + (f"/fsdp{list(self.blocks)}" if self.sharded else "")

    def describe(self) -> dict[str, Any]:
        """What the manifests record (nothing for a plain process: its manifests stay as they were; FSDP2's strategy
        and blocks only where it trains)."""
        if self.backend is None:
            return {}
        fsdp = {"distributed_strategy": "fsdp", "fsdp_blocks": self.blocks} if self.sharded else {}
        return {"world_size": self.size, "process_group_backend": self.backend, **fsdp}

    # --- FSDP2 ------------------------------------------------------------------------------------------

    def sharded_copy(self, model, device, mixed: tuple[dict, dict] = ({}, {})):
        """The module a training run updates: ``model`` itself, or under FSDP2 a copy of it sharded block by block
        (``fully_shard``, children before parents, then the root) on which the optimizer is then built. The shards live
        on ``device`` (a mesh of its type over the ranks: FSDP2 moves each block there as it shards it), and ``model``
        moves to the host. ``mixed``: the arguments of FSDP2's MixedPrecisionPolicy for the blocks and for the root
        (``precision.fsdp_mixed_precision``); empty: none.

        Raises:
            UserError: a class of ``fsdp_blocks`` names no module of the model; FSDP2 on the CPU where this torch's
                FSDP2 runs on CUDA only (torch 2.4, 2.5: ``torch_compat.fsdp2_runs_on_cpu``).
        """
        if not self.sharded:
            return model
        import copy

        fully_shard, policy = fsdp_api()
        model.cpu()  # the caller's whole model waits on the host: the device holds the shards alone
        copied = copy.deepcopy(model)
        chosen = shard_blocks(copied, self.blocks)
        kinds = sorted({type(m).__name__ for m in chosen})  # before fully_shard renames them (FSDPLinear)
        if device.type == "cpu":  # after the params' own errors (fsdp_blocks)
            from pipeline import torch_compat

            if not torch_compat.fsdp2_runs_on_cpu():
                import torch

                raise UserError(f"distributed.strategy fsdp on the CPU: this torch's FSDP2 ({torch.__version__}) makes CUDA "
                                f"streams whatever the device; use strategy: ddp on the CPU, or torch 2.6 or later")
        mesh = {"mesh": _mesh(device.type, self.size)}  # the run's device, not torch's default accelerator
        block, root = ({**mesh, "mp_policy": policy(**kwargs)} if kwargs else mesh for kwargs in mixed)
        for module in chosen:
            fully_shard(module, **block)
        fully_shard(copied, **root)
        if self.writes and not _SAID:  # once a process: which blocks its trainings shard
            _SAID.append(True)
            print(f"FSDP2 over {self.size} ranks ({self.backend}): {len(chosen)} blocks ({', '.join(kinds) or 'none'}) "
                  f"and the root, each rank holding 1/{self.size} of the training state", flush=True)
        return copied

    def agree_found_inf(self, scaler, optimizer) -> None:
        """After ``scaler.unscale_(optimizer)`` under FSDP2: every rank's inf/NaN flag becomes the max over the ranks,
        so that all skip, or none (each rank checks only its shard of the gradients). torch's DTensor already reduces
        it (torch 2.13, checked by tests/test_fsdp.py); older torch may not, and a max of equal flags changes nothing.
        The flag lives in the scaler's per-optimizer state, which torch's own ShardedGradScaler (FSDP1) reduces
        the same way."""
        if not self.sharded or not scaler.is_enabled():
            return
        import torch.distributed as dist

        for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)

    def full_state(self, model, optimizer):
        """The whole model and optimizer state of a sharded run, gathered on rank 0 (on the CPU), the optimizer's
        numbered by parameter as ``Optimizer.state_dict`` numbers it; ({}, empty) on the other ranks. Every rank
        must call it (it gathers)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        optim = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else {}
        if not self.writes:
            return {}, {"state": {}, "param_groups": []}
        names = _parameter_names(model, optimizer)
        index = {name: i for i, name in enumerate(names)}
        groups, at = [], 0
        for group in optim["param_groups"]:
            groups.append({**group, "params": list(range(at, at + len(group["params"])))})
            at += len(group["params"])
        state = {index[name]: entry for name, entry in optim["state"].items()}
        return weights, {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_full_state(self, model, optimizer):
        """A loader for ``checkpoint.restore`` and ``checkpoint.continue_optimizer``: a whole state (every rank holds it)
        put into a sharded model's and optimizer's shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True)

        # In one order on every rank: each tensor is scattered in turn, and a file's tensors come in any order (safetensors).
        def load(weights, optim) -> None:
            if weights is not None:
                set_model_state_dict(model, {k: weights[k] for k in sorted(weights)}, options=options)
            if optim is not None:
                names = _parameter_names(model, optimizer)
                state = {names[int(i)]: dict(sorted(entry.items())) for i, entry in sorted(optim["state"].items(),
                                                                                         key=lambda item: int(item[0]))}
                groups = [{**g, "params": [names[int(i)] for i in g["params"]]} for g in optim["param_groups"]]
                set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=options)

        return load


def fsdp_api():
    """``fully_shard`` and ``MixedPrecisionPolicy``: torch.distributed.fsdp since torch 2.6, its _composable home before."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _mesh(device_type: str, size: int):
    """A 1-D device mesh over the world's ranks (``init_device_mesh``, torch >= 2.2: over the whole world it uses the
    default process group, so a new one per sharded copy costs no collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (size,))


def shard_blocks(model, classes: tuple[str, ...] | list[str]) -> list:
    """The modules FSDP2 shards one by one before the root, children before parents: every module whose class is named
    in ``classes`` (or that the one ``module:function`` there returns, given the model), else each top-level child
    holding parameters. A module that shares a parameter with one outside it (tied embeddings) is left to its parent's
    block: FSDP2 gives each parameter one owner.

    Raises:
        UserError: a class in ``classes`` names no module of the model; the function returns anything but submodules.
    """
    named = list(model.named_modules())
    if len(classes) == 1 and ":" in classes[0]:
        chosen = _user_blocks(model, named, classes[0])
    elif classes:
        found = {type(m).__name__ for _, m in named}
        missing = [c for c in classes if c not in found]
        if missing:
            raise UserError(f"params.yaml: distributed.fsdp_blocks names {', '.join(map(repr, missing))}, no class of "
                            f"the model's modules; use some of {', '.join(sorted(found))[:300]}")
        chosen = [(n, m) for n, m in named if n and type(m).__name__ in classes]
    else:
        chosen = [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)

    def alone(prefix, module) -> bool:
        return all(n.startswith(prefix + ".") for p in module.parameters() for n in owners[id(p)])

    return [m for n, m in reversed(chosen) if alone(n, m)]


def _user_blocks(model, named: list, entry: str) -> list:
    """(name, module) of each block ``entry`` (``module:function``, params ``distributed.fsdp_blocks``) returns for
    ``model``, in ``named_modules`` order.

    Raises:
        UserError: the function does not import, or returns anything but submodules of the model (the root included).
    """
    import torch

    from pipeline import task

    where = f"params.yaml: distributed.fsdp_blocks {entry!r}"
    function = task.resolve(entry, "distributed.fsdp_blocks")
    try:
        returned = function(model)
    except Exception as exc:  # the user's code: its own words, in one line
        raise UserError(f"{where} raised {type(exc).__name__}: {str(exc)[:200]}; fix that function") from None
    names = {id(m): n for n, m in named if n}
    blocks = list(returned) if isinstance(returned, (list, tuple)) else None
    if blocks is None or not all(id(m) in names for m in blocks):
        raise UserError(f"{where} returned {type(returned).__name__ if blocks is None else 'a module outside the model'}; "
                        f"return a list of the model's submodules (not the model itself), e.g. list(model.layers)")
    never_called = sorted({type(m).__name__ for m in blocks if type(m).forward is torch.nn.Module.forward})
    if never_called:  # a container (ModuleList): FSDP2's hooks run around a forward it never has
        raise UserError(f"{where} returned a container that is never called ({', '.join(never_called)}); return its "
                        f"items instead, e.g. list(model.layers)")
    ids = {id(m) for m in blocks}
    return [(n, m) for n, m in named if id(m) in ids]


def _parameter_names(model, optimizer) -> list[str]:
    """The qualified names of ``optimizer``'s parameters, in its numbering (groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


_WORLD = [World()]
_SAID: list[bool] = []


def current() -> World:
    return _WORLD[0]


def init(device, cfg=None):
    """Join torchrun's process group when this process is one of its ranks; return the rank's device
    (``cuda:LOCAL_RANK`` on GPUs). A plain process: the device as given, nothing started. Under torchrun
    with one rank (``torchrun --nproc_per_node 1 -m pipeline ...`` by hand, to check that NCCL starts) the
    group is made and recorded, but nothing is wrapped or split. ``cfg``: params.distributed (its strategy and
    FSDP2 blocks); None: DDP."""
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
    strategy, classes = (cfg.strategy, tuple(cfg.fsdp_blocks)) if cfg is not None else ("ddp", ())
    _WORLD[0] = World(rank=dist.get_rank(), size=dist.get_world_size(), backend=backend, strategy=strategy, blocks=classes)
    return device


def shard_only() -> None:
    """In a process torchrun's rank started on its own (the benchmark's memory probe): take the rank's slice
    of every batch, in this process alone (no process group: no DDP, no all-reduce). Not under FSDP2: with no group
    nothing shards, so the ranks measure in their own processes (``bench.memory.memory_by_arm``)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        _WORLD[0] = World(rank=int(os.environ.get("RANK", "0")), size=size, backend=None)


def discard(name: str, chunks: Iterable | None) -> None:
    """The output sink of ranks other than 0: the chunks are never computed (inference is rank 0's)."""
