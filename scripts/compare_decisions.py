#!/usr/bin/env python3
"""Fail when a variant that a base branch accepts is rolled back (or not decided) in this run.

    python3 scripts/compare_decisions.py --base-ref origin/main [--metrics data/metrics]

Reads ``decision-<dtype>.json`` (``{"accepted": 0|1, ...}``, written by decide@DTYPE) from this run's
metrics folder and the same files as committed at ``--base-ref`` (``git show``). Exit status 1 lists each
regression on its own line; a variant the base rolls back and this run accepts is reported, not failed.
Needs only the standard library and git, so it runs in any image of the project.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PREFIX = "decision-"


def regressions(base: dict[str, dict], run: dict[str, dict]) -> tuple[list[str], list[str]]:
    """Problems (accepted on base, not accepted here) and notes (other changes), by dtype.

    ``base`` and ``run`` map a dtype to its decision metrics (``{"accepted": 0|1}``).
    """
    problems, notes = [], []
    for dtype in sorted(base):
        was = bool(base[dtype].get("accepted"))
        if dtype not in run:
            if was:
                problems.append(f"{dtype}: accepted on the base branch, not decided in this run")
            continue
        now = bool(run[dtype].get("accepted"))
        if was and not now:
            problems.append(f"{dtype}: accepted on the base branch, rolled back in this run")
        elif now and not was:
            notes.append(f"{dtype}: rolled back on the base branch, accepted in this run")
    for dtype in sorted(set(run) - set(base)):
        notes.append(
            f"{dtype}: {'accepted' if run[dtype].get('accepted') else 'rolled back'} in this run, absent on the base branch"
        )
    return problems, notes


def read_run(folder: Path) -> dict[str, dict]:
    return {p.stem[len(PREFIX) :]: json.loads(p.read_text()) for p in sorted(folder.glob(f"{PREFIX}*.json"))}


def read_ref(ref: str, folder: str) -> dict[str, dict]:
    """The decision metrics committed at ``ref`` (``git ls-tree`` then ``git show``)."""
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:{folder}"], capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        sys.exit(
            f"compare_decisions: cannot read {folder} at {ref}: {listing.stderr.strip()}; fetch it first (git fetch origin main)"
        )
    out = {}
    for name in listing.stdout.split():
        if name.startswith(PREFIX) and name.endswith(".json"):
            text = subprocess.run(["git", "show", f"{ref}:{folder}/{name}"], capture_output=True, text=True, check=True).stdout
            out[name[len(PREFIX) : -len(".json")]] = json.loads(text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-ref", default="origin/main", help="git ref whose committed decisions are the gate")
    parser.add_argument("--metrics", default="data/metrics", help="this run's metrics folder")
    args = parser.parse_args(argv)
    base = read_ref(args.base_ref, args.metrics)
    run = read_run(Path(args.metrics))
    problems, notes = regressions(base, run)
    for line in notes:
        print(f"note: {line}")
    for line in problems:
        print(f"REGRESSION: {line}", file=sys.stderr)
    if not problems:
        print(f"compare_decisions: no variant accepted on {args.base_ref} was rolled back ({len(run)} decided here)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
