"""``python -m pipeline.bench.probe --variant NAME --arm ARM``: one arm's peak memory, in a process of its own.

The benchmark stage starts one per arm on a GPU (``memory.MemoryProbes``), so that no other arm's cached
blocks count. It prints the figures as one JSON line; a user mistake exits 2 with one line.
"""

from __future__ import annotations

import argparse
import sys

from pipeline import devices, distributed
from pipeline.bench.memory import arm_memory, probe_line
from pipeline.bench.arms import arms
from pipeline.config import load_params
from pipeline.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--variant", required=True, help="the trial variant (a name in trial.variants)")
    parser.add_argument("--arm", required=True, choices=("fp32", "tf32", "amp"))
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
        device = devices.resolve(params.device)
        distributed.shard_only()  # a probe of rank 0 under torchrun: its slice of the batch, in this process alone
        policy = params.trial.policy(args.variant)
        chosen = {a.name: a for a in arms(policy, devices.describe(device))[0]}
        if args.arm not in chosen:
            raise UserError(f"--arm {args.arm} is not measured on this device; use one of {sorted(chosen)}")
        probe = arm_memory(params, args.variant, chosen[args.arm], device)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(probe_line(probe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
