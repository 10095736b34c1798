"""What keeping each token's KL costs a compact trial (``compact.KL``), against the compact encoding it adds to.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_compact_kl.py [--tokens 256] [--vocab 32000] [--repeats 7]

One chunk of LM-like scores [tokens / 64, 64, vocab] (float32, a spread of about 3 nats, the trial as bfloat16 rounds
it), written as trial@NAME writes its outputs (``outputs.write_outputs``), the reference beside it stored full:
- ``full``: the trial stored full (what ``compare.store: full`` writes);
- ``compact``: stored compact without KL (format 3's work: codes, best classes, row statistics): the yardstick;
- ``compact+kl torch`` and ``compact+kl kernels``: compact, keeping each token's KL against the reference
  (``decisions.token_kl``: torch's path below ``native.MIN_ELEMENTS`` elements, compare's C kernels above).
Each runs ``--repeats`` times, interleaved; times are the process's CPU time (every thread's), which other work on a
shared machine moves less than wall time (one thread, ``OMP_NUM_THREADS=1``, moves least: no thread spins waiting for
another). The best time of each and its ratio to ``compact`` are printed, all from this run, with the bytes the KL adds
to the file. Then compare (``streams.compare_streams``) reads the reference with the compact trial and with the one
keeping KL (torch's path), interleaved too: the second's ratio to the first is what reading the stored KL costs compare.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import torch

    from pipeline.artifacts import outputs
    from pipeline.compare import decisions, native

    t = 64
    n = max(1, args.tokens // t)
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(n, t, args.vocab, generator=g) * 3
    ref[..., :8] += torch.rand(n, t, 1, generator=g) * 12
    trial = ref.to(torch.bfloat16).float()
    ids = [f"ordinary/{i}" for i in range(n)]
    kernels = native.available()

    def kl_by(elements: int):
        return lambda r, x, k, _: decisions.token_kl(r, x, k, elements)  # the path chosen for a file of this size

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        outputs.write_outputs(folder / "reference.safetensors", [{"logits": ref}], ids)
        reference = outputs.OutputsReader(folder / "reference.safetensors")
        runs = {
            "full": {"store": "full"},
            "compact": {"store": "compact"},
            "compact+kl torch": {"store": "compact", "kl_against": outputs.KlAgainst(lambda: reference, kl_by(0))},
        }
        if kernels:
            runs["compact+kl kernels"] = {"store": "compact", "kl_against": outputs.KlAgainst(
                lambda: reference, kl_by(native.MIN_ELEMENTS))}
        best = dict.fromkeys(runs, float("inf"))
        sizes = {}
        for _ in range(args.repeats):
            for name, kwargs in runs.items():
                path = folder / f"{name}.safetensors"
                start = time.process_time()
                outputs.write_outputs(path, [{"logits": trial}], ids, **kwargs)
                best[name] = min(best[name], time.process_time() - start)
                sizes[name] = path.stat().st_size
        load = os.getloadavg()[0]
        print(f"{n * t} tokens x {args.vocab} classes, torch threads {torch.get_num_threads()}, load {load:.1f}, "
              f"CPU time, best of {args.repeats}; kernels {'built' if kernels else 'unavailable'}")
        yard = best["compact"]
        for name, seconds in best.items():
            print(f"  {name:20s} {1000 * seconds:8.1f} ms   {seconds / yard:5.2f} x compact   {sizes[name]:>12,d} bytes")
        extra = sizes["compact+kl torch"] - sizes["compact"]
        print(f"  KL adds {extra:,d} bytes ({extra / (n * t):.0f} per token, {100 * extra / sizes['compact']:.3f} % of "
              "the file)")
        compared = _compare_times(reference, {name: folder / f"{name}.safetensors" for name in ("compact", "compact+kl torch")},
                                  ids, args.repeats)
    print(f"  compare, compact trial {1000 * compared['compact']:.1f} ms; keeping KL "
          f"{1000 * compared['compact+kl torch']:.1f} ms ({compared['compact+kl torch'] / compared['compact']:.2f} x)")


def _compare_times(reference, paths: dict[str, Path], ids: list[str], repeats: int) -> dict[str, float]:
    """Best time of ``streams.compare_streams`` of ``reference`` against each trial of ``paths``, interleaved."""
    import torch

    from pipeline.artifacts import outputs
    from pipeline.artifacts.steps import StepRecord
    from pipeline.compare import streams
    from pipeline.config import AcceptanceConfig

    steps = tuple(StepRecord(step=i, loss=1.0 / (i + 1), grad_norm=1.0, scale=1.0, skipped=False, real_updates=i + 1,
                             lr=0.1, nonfinite_grad=False) for i in range(4))
    n, t = reference.shape("logits")[:2]
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, path in paths.items():
            trial = outputs.OutputsReader(path)
            sources = streams.Sources(ids, torch.zeros(n, t, dtype=torch.long), torch.ones(n, dtype=torch.bool),
                                      reference, trial, trial)
            start = time.process_time()
            streams.compare_streams("classification", AcceptanceConfig(), sources, streams.Trajectories(steps, steps, 1.0))
            best[name] = min(best[name], time.process_time() - start)
    return best


if __name__ == "__main__":
    main()
