#!/usr/bin/env python3
"""The rule's false-rollback rate, measured: FP32 judged against FP32 (issue 48, item 2).

The variant float32_swapped is FP32 again on another data order, nothing else changed (params.yaml trial.policies):
every rollback of it is a false one. Over N seeds and two models, this script runs it and counts the rollbacks.

    python scripts/false_rollback_rate.py                         # 20 seeds x digits and transformer (docs/rule.md)
    python scripts/false_rollback_rate.py --seeds 5 --models digits --jobs 1

Per model and seed: a copy of this project (scripts/_project.py, uncommitted edits included) whose params.yaml is
the model's with that ``seed`` and ``trial.variants: [float32_swapped]``; then dvc.yaml's commands for prepare,
freeze, trial, compare, diagnose and decide, run as ``python -m pipeline STAGE`` in its order (no dvc, no network).
A seed moves the model's initial weights, the data order, and so both FP32 runs the rule compares. A seed whose
FP32 freeze refuses as a baseline (its quality below min_quality: no trial runs) is listed and replaced by the next
one, up to 2N seeds.

Prints one row per model: seeds, rollbacks, the rate and its Clopper-Pearson upper bound at 95 %
(``bounds.binomial_upper``), the criteria that rolled back, and how close the loss curves came to the noise floor
(the trial's mean loss gap over the replicate's, which the rule allows up to loss_noise_multiple). Figures, not a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import _project

from pipeline.compare.bounds import binomial_upper

VARIANT = "float32_swapped"
STAGES = ("prepare", "freeze", f"trial@{VARIANT}", f"compare@{VARIANT}", f"diagnose@{VARIANT}", f"decide@{VARIANT}")
MODELS = {
    # The default example (digits, SGD) at its shipped size: 60 updates of 64 samples, 256 fixed cases.
    "digits": lambda: _project.params(),
    # The transformer example at its tiny size (sizes/transformer-tiny.yaml: 40 Adam updates of 32 sequences) with the
    # default's 256 fixed cases: about 0.95 accuracy, so that quality after training can move (at sizes/transformer-cpu
    # it is 1.0 in every run, and the quality criteria would be judged on nothing).
    "transformer": lambda: _project.merge(_project.transformer("tiny"),
                                          {"task": {"options": {"n_eval": 256}}, "prepare": {"ordinary_cases": 256}}),
}


@dataclass(frozen=True)
class Outcome:
    model: str
    seed: int
    decision: str
    criteria: tuple[str, ...]
    """The failed criteria (``criterion``)."""
    reasons: tuple[str, ...]
    """The decision's reasons, whole (or freeze's refusal)."""
    mean_ratio: float
    """The trial's mean loss gap over the FP32 replicate's (the noise floor allows up to loss_noise_multiple)."""
    max_ratio: float
    """The trial's largest loss gap over the replicate's (allowed as much)."""
    seconds: float


CRITERIA = (  # (words of a reason, the criterion it names), first match wins; any other reason: its opening words
    ("loss curve above the noise floor", "training: loss curve vs FP32's gap"),
    ("training: final loss", "training: final loss vs FP32's bound"),
    ("quality after training", "below minimum", "quality after training: min_quality"),
    ("quality after training", "", "quality after training: drop vs FP32's bound"),
)


def criterion(reason: str) -> str:
    """The criterion a rollback reason names (``training: final loss vs FP32's bound``)."""
    for *words, name in CRITERIA:
        if all(w in reason for w in words):
            return name
    return reason.split(": ")[0]


def run_one(model: str, seed: int, base: dict, work: Path) -> Outcome:
    """One seed of one model in a copy of its own: the six stages, then its decision."""
    repo = work / f"{model}-{seed}"
    override = {"seed": seed, "trial": {"variants": [VARIANT]}}
    _project.copy(repo, base=base, override=override)
    values = _project.params(repo)
    t0 = time.monotonic()
    for stage in (s for s in _project.plan(values, repo) if s.name in STAGES):
        proc = _project.run(stage.argv(), repo, check=stage.name != "freeze", timeout=1800)
        if proc.returncode == 2:  # freeze refused this seed's FP32 as a baseline (a quality below min_quality): no trial
            refusal = proc.stderr.strip().splitlines()[-1].removeprefix("error: ").split(",")[0]
            shutil.rmtree(repo, ignore_errors=True)
            return Outcome(model, seed, "refused", ("refused at freeze",), (refusal,), math.nan, math.nan,
                           time.monotonic() - t0)
        if proc.returncode != 0:
            raise AssertionError(f"{stage.name} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    decision = json.loads((repo / f"data/decision/{VARIANT}/decision.json").read_text())
    ratios = _ratios(repo)
    shutil.rmtree(repo, ignore_errors=True)
    reasons = tuple(decision["reasons"])
    return Outcome(model, seed, decision["decision"], tuple(criterion(r) for r in reasons), reasons, *ratios,
                   time.monotonic() - t0)


def _ratios(repo: Path) -> tuple[float, float]:
    """compare's noise figures: the trial's mean and largest loss gaps over the replicate's (nan where there are none)."""
    stats = json.loads((repo / "data/compare" / VARIANT / "stats.json").read_text())
    noise = (stats.get("training") or {}).get("noise") or {}
    mean, largest = noise.get("mean_ratio"), None
    if noise.get("max_replicate_gap"):
        largest = noise["max_amp_gap"] / noise["max_replicate_gap"]
    return (math.nan if mean is None else float(mean)), (math.nan if largest is None else float(largest))


def table(outcomes: list[Outcome], confidence: float) -> str:
    """One row per model: the counts, the rate with its upper bound, the criteria, the ratios to the noise floor."""
    rows = [f"| model | seeds | rollbacks | rate | {confidence:.0%} upper bound | criteria that rolled back | "
            "loss-gap ratio to FP32's, mean gap: median / max | largest gap: median / max |",
            "|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(o.model for o in outcomes):
        mine = [o for o in outcomes if o.model == model and o.decision != "refused"]
        n, k = len(mine), sum(o.decision == "rollback" for o in mine)
        causes = collections.Counter(c for o in mine for c in o.criteria)
        named = "; ".join(f"{c} ({count})" for c, count in causes.most_common()) or "none"
        refused = [o.seed for o in outcomes if o.model == model and o.decision == "refused"]
        seeds = f"{n}" + (f" (+{len(refused)} refused at freeze: seed {', '.join(map(str, refused))})" if refused else "")
        spread = [_spread([getattr(o, side) for o in mine]) for side in ("mean_ratio", "max_ratio")]
        rate = f"{k / n:.1%}" if n else "n/a"
        rows.append(f"| {model} | {seeds} | {k} | {rate} | {binomial_upper(k, n, confidence):.1%} | {named} | "
                    f"{spread[0]} | {spread[1]} |")
    return "\n".join(rows)


def _spread(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    return f"{statistics.median(finite):.2f} / {max(finite):.2f}" if finite else "n/a"


def _say(o: Outcome) -> None:
    ratios = f" (loss-gap ratios {o.mean_ratio:.2f} mean, {o.max_ratio:.2f} largest)" if o.decision != "refused" else ""
    print(f"{o.model} seed {o.seed}: {o.decision}{ratios}, {o.seconds:.0f} s", flush=True)
    for reason in o.reasons:
        print(f"    {reason}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="judged seeds per model, from 0 (default 20)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--jobs", type=int, default=2, help="seeds run at once, one thread each (default 2)")
    parser.add_argument("--confidence", type=float, default=0.95)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="amp-false-rollback-"))
    bases = {m: MODELS[m]() for m in args.models}
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for model in args.models:  # seeds 0, 1, ... until N are judged (a seed freeze refuses is replaced, up to 2N)
                seed = 0
                while (judged := sum(o.model == model and o.decision != "refused" for o in outcomes)) < args.seeds:
                    if seed >= 2 * args.seeds:
                        break
                    todo = range(seed, min(seed + args.seeds - judged, 2 * args.seeds))
                    seed = todo.stop
                    for o in pool.map(lambda s, m=model: run_one(m, s, bases[m], work), todo):
                        outcomes.append(o)
                        _say(o)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nFP32 against FP32 ({VARIANT}), {time.monotonic() - t0:.0f} s:\n")
    print(table(outcomes, args.confidence))
    return 0


if __name__ == "__main__":
    sys.exit(main())
