"""``python -m pipeline.bench.probe --dtype D --variant V``: one variant's peak memory, in a process of its own.

The benchmark stage starts one per variant on a GPU (``memory.MemoryProbes``), so that no other variant's
cached blocks count. It prints the figures as one JSON line; a user mistake exits 2 with one line.
"""

from __future__ import annotations

import argparse
import sys

from pipeline import devices, distributed
from pipeline.bench.memory import probe_line, variant_memory
from pipeline.bench.variants import variants
from pipeline.config import load_params
from pipeline.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--variant", required=True, choices=("fp32", "tf32", "amp"))
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
        device = devices.resolve(params.device)
        distributed.shard_only()  # a probe of rank 0 under torchrun: its slice of the batch, in this process alone
        chosen = {v.name: v for v in variants(args.dtype, tuple(params.trial.fp32_modules), devices.describe(device))[0]}
        if args.variant not in chosen:
            raise UserError(f"--variant {args.variant} is not measured on this device; use one of {sorted(chosen)}")
        probe = variant_memory(params, args.dtype, chosen[args.variant], device)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(probe_line(probe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
