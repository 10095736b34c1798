#!/usr/bin/env python3
"""Memory per rank of FSDP2 against DDP, on the CPU (issue 52 item 6): figures, not a test.

    python scripts/fsdp_memory.py                       # 2 ranks, a 25M-parameter MLP, 3 AdamW updates
    python scripts/fsdp_memory.py --ranks 2 --width 2048 --layers 6 --steps 3

Each strategy runs in 2 fresh gloo processes (torch.multiprocessing), the way the training loop runs it
(pipeline/training.py): the whole FP32 model is built on every rank, then trained by DistributedDataParallel
around it, or by FSDP2's sharded copy of it (``distributed.World.sharded_copy``: one block per layer, then the root)
while the whole model stays beside it, as the pipeline keeps it for rank 0's inference. A third run drops the whole
model once sharded: what building it on the meta device would save (the pipeline does not do that yet).

Per rank, three figures, in MiB and as ratios to DDP: the training state it holds (local parameters, gradients and
AdamW moments, counted from the tensors); the resident memory it grew by from just before the model was built to
just after the last update (``/proc/self/statm``: the same state, plus DDP's gradient buckets, the whole model kept
beside FSDP2's shards, allocator slack); and the peak of it (``ru_maxrss``: also the transients, such as the
whole copy FSDP2 shards from and the all-gathered blocks of a forward and backward).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _now_mib() -> float:
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor: this rank's shard
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _rank(rank: int, size: int, mode: str, args: argparse.Namespace, folder: str) -> None:
    import torch
    import torch.distributed as dist

    from pipeline import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rdv-{mode}", rank=rank, world_size=size)
    world = distributed.World(rank=rank, size=size, backend="gloo", strategy="ddp" if mode == "ddp" else "fsdp")
    distributed._WORLD[0] = world
    _train(world, mode, lambda: _mlp(8, 1), 8, 1, 1)  # imports and first calls, before the baseline
    gc.collect()
    before, peak_before = _now_mib(), _peak_mib()
    torch.manual_seed(0)
    trainee, optimizer, model = _train(world, mode, lambda: _mlp(args.width, args.layers), args.width, args.rows, args.steps)
    state = [*trainee.parameters(), *(p.grad for p in trainee.parameters() if p.grad is not None)]
    state += [v for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v)]
    held = _bytes(state)
    whole = 0 if model is None else _bytes(model.parameters())
    gc.collect()
    out = {"state_mib": held / 2**20, "whole_mib": whole / 2**20, "rss_mib": _now_mib() - before,
           "peak_mib": _peak_mib() - peak_before}
    Path(folder, f"{mode}-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _mlp(width: int, layers: int):
    import torch

    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


def _train(world, mode: str, build, width: int, rows: int, steps: int):
    """``steps`` AdamW updates of the model ``build`` makes, under ``mode``: the trained module, its optimizer, and the
    whole model where one is kept beside it (FSDP2 as the pipeline runs it), else None."""
    import torch

    model = build()
    if mode == "ddp":
        trainee, net = model, world.wrap(model, torch.device("cpu"))
    else:
        trainee = net = world.sharded_copy(model, torch.device("cpu"))
    if mode != "fsdp":
        model = None
        gc.collect()
    optimizer = torch.optim.AdamW(trainee.parameters(), lr=1e-4)
    x, y = torch.randn(rows, width), torch.randint(0, 10, (rows,))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)  # keep the gradients: counted
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    return trainee, optimizer, model


def measure(args: argparse.Namespace) -> dict[str, list[dict]]:
    import os

    import torch.multiprocessing as mp

    # Large blocks straight from mmap, given back when freed (no dynamic threshold keeping freed tensors resident in
    # the heap): the resident memory then follows the live tensors. The ranks read it as they start.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("ddp", "fsdp", "fsdp-shards-only"):
            mp.spawn(_rank, args=(args.ranks, mode, args, folder), nprocs=args.ranks, join=True)
            out[mode] = [json.loads(Path(folder, f"{mode}-{r}.json").read_text()) for r in range(args.ranks)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8, help="rows per rank and step (activations stay small)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    params = args.layers * (args.width * args.width + args.width) + args.width * 10 + 10
    figures = measure(args)
    print(f"{params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB in FP32), AdamW, {args.ranks} gloo ranks, "
          f"{args.steps} updates; per rank (rank 0; max over ranks in brackets)")
    ddp = figures["ddp"][0]
    print(f"{'strategy':<18}{'state MiB':>10}{'ratio':>7}{'whole model':>12}{'RSS after MiB':>20}{'ratio':>7}"
          f"{'peak RSS MiB':>20}{'ratio':>7}")
    for mode, ranks in figures.items():
        first = ranks[0]
        line = f"{mode:<18}{first['state_mib']:>10.0f}{first['state_mib'] / ddp['state_mib']:>7.2f}{first['whole_mib']:>12.0f}"
        for key in ("rss_mib", "peak_mib"):
            most = max(r[key] for r in ranks)
            line += f"{first[key]:>13.0f} [{most:>4.0f}]{first[key] / ddp[key]:>7.2f}"
        print(line)


if __name__ == "__main__":
    main()
