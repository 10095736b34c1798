"""Throughput and peak memory of compare on large synthetic outputs, against a plain numpy pass.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_compare.py [--scale 1.0] [--threads 1] [--chunk-elements 4000000] \
        [--repeats 3] [--keep DIR] [--device cpu|cuda]

Two cases, written once to a temporary folder with ``outputs.write_outputs`` (the format freeze and
trial write), then compared by ``streams.compare_streams`` in a fresh process each:
- classification: 50,000 cases x 1,000 classes (5e7 elements), trial = reference rounded to float16;
- per token: 60 sequences x 250 tokens x 4,000-token vocabulary (6e7 elements), trial rounded to bfloat16.

For each it prints elements/s of compare (reference, trial and trained trial all read, every statistic),
and of a plain numpy pass reading the same bytes chunk by chunk (np.fromfile + one sum: the memory-bandwidth
floor), their ratio, the peak RSS, the interpreter's RSS after imports and the size of one chunk, all
measured in the same run. Each measurement runs in its own process, so that peak RSS is its own; compare
and the floor alternate ``--repeats`` times (on a shared machine the load changes from second to second):
the median speed of each, the median of the paired ratios, and the worst peak RSS of compare are printed.
Outputs this large go through compare's C kernels (``compare.native``); ``AMP_COMPARE_KERNELS=off`` measures torch's
path alone. ``--device cuda`` runs compare's arithmetic on the GPU (``compare_streams(device=)``: each chunk is read on the host
and copied there), as the compare stage does where ``device`` resolves to a GPU; the numpy floor stays on the host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {
    "classification": {"rows": 50_000, "shape": (1_000,), "round": "float16"},
    "per_token": {"rows": 60, "shape": (250, 4_000), "round": "bfloat16"},
}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def make(case: str, folder: Path, scale: float) -> dict:
    """Write reference, trial and trained outputs of one case, chunk by chunk; return its description."""
    import torch

    from pipeline.artifacts import outputs

    spec = CASES[case]
    rows = max(2, int(spec["rows"] * scale))
    shape = spec["shape"]
    dtype = getattr(torch, spec["round"])
    per_token = len(shape) == 2
    ids = [f"ordinary/{i}" for i in range(rows - rows // 50)] + [f"edge/{i}" for i in range(rows // 50)]
    g = torch.Generator().manual_seed(0)
    step = max(1, 2_000_000 // int(torch.Size(shape).numel()))

    def chunks(kind: str):
        gen = torch.Generator().manual_seed(1)
        for s in range(0, rows, step):
            n = min(step, rows - s)
            ref = torch.randn((n, *shape), generator=gen) * 3
            if kind == "reference":
                yield {"logits": ref}
            else:
                yield {"logits": ref.to(dtype).float()}

    for kind in ("reference", "trial", "trained"):
        outputs.write_outputs(folder / f"{case}-{kind}.safetensors", chunks(kind), ids)
    targets_shape = (rows, shape[0]) if per_token else (rows,)
    targets = torch.randint(0, shape[-1], targets_shape, generator=g)
    from safetensors.torch import save_file

    has_target = torch.tensor([i.startswith("ordinary/") for i in ids])
    save_file({"y": targets, "has_target": has_target}, str(folder / f"{case}-targets.safetensors"))
    return {"rows": rows, "elements": rows * int(torch.Size(shape).numel())}


def measure_compare(case: str, folder: Path, chunk_elements: int, threads: int, device: str = "cpu") -> dict:
    import torch

    torch.set_num_threads(threads)
    from safetensors.torch import load_file

    from pipeline.artifacts.steps import StepRecord
    from pipeline.compare import streams
    from pipeline.config import AcceptanceConfig, CompareConfig
    from pipeline.artifacts.outputs import OutputsReader

    # The interpreter: Python, torch and the pipeline imported, and every kernel compare uses run once on a
    # tiny input (their one-time allocations are the interpreter's, not the chunk's).
    tiny = {"logits": torch.randn((4, 3, 8) if case == "per_token" else (4, 8))}
    tiny_y = torch.zeros((4, 3) if case == "per_token" else (4,), dtype=torch.long)
    steps = (StepRecord(step=0, loss=1.0, grad_norm=1.0, scale=1.0, skipped=False, real_updates=1, lr=0.1),)
    runs = streams.Trajectories(steps, steps, 1.0)
    warm = streams.Sources([f"ordinary/{i}" for i in range(4)], tiny_y, torch.ones(4, dtype=torch.bool), streams.InMemory(tiny),
                           streams.InMemory(tiny), streams.InMemory(tiny))
    streams.compare_streams("classification", AcceptanceConfig(), warm, runs, device=device)
    base = _current_rss_mb()
    t = load_file(str(folder / f"{case}-targets.safetensors"))
    ref = OutputsReader(folder / f"{case}-reference.safetensors")
    trial = OutputsReader(folder / f"{case}-trial.safetensors")
    trained = OutputsReader(folder / f"{case}-trained.safetensors")
    start = time.perf_counter()
    sources = streams.Sources(ref.ids, t["y"], t["has_target"], ref, trial, trained)
    stats, table = streams.compare_streams("classification", AcceptanceConfig(), sources, runs,
                                           cfg=CompareConfig(chunk_elements=chunk_elements), device=device)
    seconds = time.perf_counter() - start
    n = stats.values["logits"].elements
    return {
        "seconds": seconds,
        "elements": n,
        "elements_per_s": n / seconds,
        "peak_rss_mb": _rss_mb(),
        "interpreter_rss_mb": base,
        "chunk_mb": chunk_elements * 4 / 2**20,
        "sources": 3,
        "flips": stats.flips.flips + stats.flips.near_boundary_flips,
        "kl_mean": stats.distribution.kl_mean if stats.distribution is not None else None,
        "table_rows": len(table),
        "kernels": bool(stats.outputs.kernels),
    }


def measure_numpy(case: str, folder: Path, chunk_elements: int) -> dict:
    """The floor: read the same bytes (reference, trial, trained) chunk by chunk with numpy, one sum each."""
    import numpy as np

    base = _current_rss_mb()
    files = [folder / f"{case}-{k}.safetensors" for k in ("reference", "trial", "trained")]
    start = time.perf_counter()
    total = 0.0
    n = 0
    for path in files:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
            begin, end = header["logits"]["data_offsets"]
            fh.seek(8 + size + begin)
            remaining = (end - begin) // 4
            while remaining:
                count = min(chunk_elements, remaining)
                a = np.fromfile(fh, dtype=np.float32, count=count)
                total += float(a.sum(dtype=np.float64))
                remaining -= count
                if path == files[0]:
                    n += count
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "elements": n, "elements_per_s": n / seconds, "peak_rss_mb": _rss_mb(),
            "interpreter_rss_mb": base, "checksum": total}


def child(args: argparse.Namespace) -> None:
    folder = Path(args.folder)
    if args.child == "make":
        result = make(args.case, folder, args.scale)
    elif args.child == "compare":
        result = measure_compare(args.case, folder, args.chunk_elements, args.threads, args.device)
    else:
        result = measure_numpy(args.case, folder, args.chunk_elements)
    print(json.dumps(result))


def run_child(kind: str, case: str, folder: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--case", case, "--folder", str(folder), "--scale", str(args.scale),
           "--chunk-elements", str(args.chunk_elements), "--threads", str(args.threads), "--device", args.device]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    """The run of median speed (the upper one of an even count)."""
    return dict(sorted(runs, key=lambda r: r["elements_per_s"])[len(runs) // 2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of cases (1.0: 5e7 and 6e7 elements)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-elements", type=int, default=4_000_000)
    parser.add_argument("--cases", default="classification,per_token")
    parser.add_argument("--repeats", type=int, default=3,
                        help="compare and the numpy floor alternate this many times; medians of each and of the paired ratios")
    parser.add_argument("--keep", default=None, help="write the outputs here and keep them (default: a temporary folder)")
    parser.add_argument("--device", default="cpu", help="where compare's arithmetic runs: cpu, or cuda (a GPU)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import platform

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU(s); threads {args.threads}; "
          f"chunk {args.chunk_elements:,} elements; compare on {args.device}")
    with contextlib.ExitStack() as stack:
        if args.keep:  # the outputs stay there for another run or a profiler
            folder = Path(args.keep)
            folder.mkdir(parents=True, exist_ok=True)
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-compare-")))
        for case in args.cases.split(","):
            made = run_child("make", case, folder, args)
            runs = [(run_child("compare", case, folder, args), run_child("numpy", case, folder, args))
                    for _ in range(args.repeats)]
            ratios = sorted(c["elements_per_s"] / f["elements_per_s"] for c, f in runs)
            cmp = _median([c for c, _ in runs])
            cmp["peak_rss_mb"] = max(c["peak_rss_mb"] for c, _ in runs)  # the worst peak, the median speed
            floor = _median([f for _, f in runs])
            print(
                f"{case}: {made['elements']:.3g} elements ({made['rows']} cases); compare {cmp['seconds']:.2f} s = "
                f"{cmp['elements_per_s'] / 1e6:.1f} M elements/s; numpy floor {floor['elements_per_s'] / 1e6:.1f} M elements/s "
                f"(medians of {len(ratios)} interleaved runs; median of the paired ratios "
                f"{ratios[len(ratios) // 2]:.3f}); peak RSS {cmp['peak_rss_mb']:.0f} MB "
                f"= interpreter {cmp['interpreter_rss_mb']:.0f} MB + {cmp['peak_rss_mb'] - cmp['interpreter_rss_mb']:.0f} MB = "
                f"{(cmp['peak_rss_mb'] - cmp['interpreter_rss_mb']) / (cmp['chunk_mb'] * cmp['sources']):.2f} x one chunk "
                f"({cmp['sources']} sources x {cmp['chunk_mb']:.0f} MB); "
                f"numpy peak RSS {floor['peak_rss_mb']:.0f} MB; flips {cmp['flips']}, table rows {cmp['table_rows']}"
                + (f", KL mean {cmp['kl_mean']:.3g}" if cmp["kl_mean"] is not None else "")
                + ("; through the C kernels" if cmp["kernels"] else "; torch alone (no C kernels)")
            )


if __name__ == "__main__":
    main()
