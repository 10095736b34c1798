#!/usr/bin/env python3
"""Fail when a variant that a base branch accepts is rolled back (or not decided) in this run, or when this
run did not run on the backend it was meant to.

    python3 scripts/compare_decisions.py --base-ref origin/main [--metrics data/metrics] [--expect-backend cuda|rocm]

Reads each dtype's decision metrics from this run's metrics folder and the same files as committed at
``--base-ref`` (``git show``): ``<dtype>.json`` (``{"decision": 1|0, ...}``, written by decide@DTYPE) or, as
older commits hold them, ``decision-<dtype>.json`` (``{"accepted": 1|0}``). Exit status 1 lists each
regression on its own line; a variant the base rolls back and this run accepts is reported, not failed.

``--expect-backend`` also reads the manifests (reference, each trial) and each benchmark record and fails
unless every one says that backend ran (``env.backend``): a GPU job whose GPU was not reachable, and that
quietly ran on the CPU, fails here. Needs only the standard library and git, so it runs in any image.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DTYPES = ("float16", "bfloat16")
LEGACY_PREFIX = "decision-"


def accepted(metrics: dict) -> bool:
    """Whether a decision metrics file says accept: ``decision: accept`` (this version), ``decision: 1`` (earlier
    ones) or the older ``accepted``."""
    value = metrics.get("decision", metrics.get("accepted"))
    return value == "accept" if isinstance(value, str) else bool(value)


def regressions(base: dict[str, dict], run: dict[str, dict]) -> tuple[list[str], list[str]]:
    """Problems (accepted on base, not accepted here) and notes (other changes), by dtype.

    ``base`` and ``run`` map a dtype to its decision metrics.
    """
    problems, notes = [], []
    for dtype in sorted(base):
        was = accepted(base[dtype])
        if dtype not in run:
            if was:
                problems.append(f"{dtype}: accepted on the base branch, not decided in this run")
            continue
        now = accepted(run[dtype])
        if was and not now:
            problems.append(f"{dtype}: accepted on the base branch, rolled back in this run")
        elif now and not was:
            notes.append(f"{dtype}: rolled back on the base branch, accepted in this run")
    for dtype in sorted(set(run) - set(base)):
        notes.append(f"{dtype}: {'accepted' if accepted(run[dtype]) else 'rolled back'} in this run, absent on the base branch")
    return problems, notes


def dtype_of(name: str) -> str | None:
    """The dtype a metrics file name is the decision of, or None (``float16.json``, ``decision-float16.json``)."""
    if not name.endswith(".json"):
        return None
    stem = name[: -len(".json")].removeprefix(LEGACY_PREFIX)
    return stem if stem in DTYPES else None


def read_run(folder: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json"), key=lambda p: p.name.startswith(LEGACY_PREFIX)):  # new files win
        dtype = dtype_of(path.name)
        if dtype and dtype not in out:
            out[dtype] = json.loads(path.read_text())
    return out


def read_ref(ref: str, folder: str) -> dict[str, dict]:
    """The decision metrics committed at ``ref`` (``git ls-tree`` then ``git show``)."""
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:{folder}"], capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        sys.exit(
            f"compare_decisions: cannot read {folder} at {ref}: {listing.stderr.strip()}; fetch it first (git fetch origin main)"
        )
    out: dict[str, dict] = {}
    for name in sorted(listing.stdout.split(), key=lambda n: n.startswith(LEGACY_PREFIX)):
        dtype = dtype_of(name)
        if dtype and dtype not in out:
            text = subprocess.run(["git", "show", f"{ref}:{folder}/{name}"], capture_output=True, text=True, check=True).stdout
            out[dtype] = json.loads(text)
    return out


def backend_problems(data: Path, expected: str) -> list[str]:
    """Every record of this run that does not say ``expected`` ran it (or that is missing)."""
    records = [data / "reference" / "manifest.json", *sorted((data / "trial").glob("*/manifest.json"))]
    if not (data / "trial").is_dir() or not any((data / "trial").glob("*/manifest.json")):
        records.append(data / "trial" / "<dtype>" / "manifest.json")
    benchmarks = sorted((data / "benchmark").glob("*/benchmark.json"))
    problems = []
    for path in records + benchmarks:
        if not path.is_file():
            problems.append(f"{path}: missing, so nothing proves which backend ran")
            continue
        record = json.loads(path.read_text())
        if path in benchmarks and not record.get("benchmarked"):
            continue  # a rolled-back variant is not benchmarked: no env to check
        backend = (record.get("env") or {}).get("backend")
        if backend != expected:
            problems.append(f"{path}: ran on {backend or 'an unrecorded backend'}, not {expected}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-ref", default="origin/main", help="git ref whose committed decisions are the gate")
    parser.add_argument("--metrics", default="data/metrics", help="this run's metrics folder")
    parser.add_argument("--data", default="data", help="this run's data folder (manifests, for --expect-backend)")
    parser.add_argument(
        "--expect-backend", choices=("cpu", "cuda", "rocm"), help="fail unless every record says this backend ran"
    )
    args = parser.parse_args(argv)
    base = read_ref(args.base_ref, args.metrics)
    run = read_run(Path(args.metrics))
    problems, notes = regressions(base, run)
    if args.expect_backend:
        problems += backend_problems(Path(args.data), args.expect_backend)
    for line in notes:
        print(f"note: {line}")
    for line in problems:
        print(f"REGRESSION: {line}", file=sys.stderr)
    if not problems:
        checked = f"; every record ran on {args.expect_backend}" if args.expect_backend else ""
        print(f"compare_decisions: no variant accepted on {args.base_ref} was rolled back ({len(run)} decided here){checked}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
