"""The one table of output paths. dvc.yaml declares the same paths; a test keeps the two in step."""

from __future__ import annotations

from pathlib import Path

DATA = Path("data")

PREPARED = DATA / "prepared"
PREPARED_CASES = PREPARED / "cases.safetensors"
PREPARED_TRAIN = PREPARED / "train.safetensors"

REFERENCE = DATA / "reference"
REF_INIT = REFERENCE / "init.safetensors"
REF_CHECKPOINT = REFERENCE / "checkpoint.safetensors"
REF_CASES = REFERENCE / "cases.safetensors"
REF_OUTPUTS = REFERENCE / "outputs.safetensors"
REF_OUTPUTS_FP64 = REFERENCE / "outputs_fp64.safetensors"
REF_TRAJECTORY = REFERENCE / "trajectory.json"
REF_REPLICATE_TRAJECTORY = REFERENCE / "replicate_trajectory.json"  # FP32 noise replicate (reference.noise_replicate)
REF_MANIFEST = REFERENCE / "manifest.json"
REF_FORECAST = REFERENCE / "forecast.json"  # the FP16 headroom forecast (pipeline/artifacts/forecast.py)

METRICS = DATA / "metrics"  # DVC metrics, kept in git (cache: false) so `dvc metrics diff` works across commits
RESUME = DATA / "resume"  # not a DVC output: DVC deletes outputs before a stage runs
SYSTEM_METRICS = DATA / "system-metrics"  # not a DVC output: GPU samples of a stage's last run (pipeline/sysmetrics.py)


def system_metrics(stage: str, variant: str) -> Path:
    """The GPU samples of ``stage`` (trial, benchmark) for ``variant``; publish logs them into its child run."""
    return SYSTEM_METRICS / f"{stage}-{variant}.json"


def trial(variant: str) -> Path:
    return DATA / "trial" / variant


# The files of one trial folder (``trial(variant) / NAME``; pipeline/artifacts/trial.py and trial_tensors.py write and read them).
TRIAL_OUTPUTS = "outputs.safetensors"
TRIAL_TRAINED_OUTPUTS = "trained_outputs.safetensors"
TRIAL_CHECKPOINT = "checkpoint.safetensors"
TRIAL_TRAJECTORY = "trajectory.json"
TRIAL_MANIFEST = "manifest.json"
TRIAL_AUDIT = "audit.json"  # the "AMP engaged" audit (pipeline/artifacts/audit.py)


def compare(variant: str) -> Path:
    return DATA / "compare" / variant


def diagnose(variant: str) -> Path:
    return DATA / "diagnose" / variant


def decision(variant: str) -> Path:
    return DATA / "decision" / variant


def benchmark(variant: str) -> Path:
    return DATA / "benchmark" / variant


def benchmark_metrics(variant: str) -> Path:
    """The benchmark's two DVC metrics (speedup: the median FP32/AMP time ratio, mem_ratio: peak process memory
    AMP/FP32); details in benchmark(variant)/benchmark.json."""
    return METRICS / f"bench-{variant}.json"


def compare_metrics(variant: str) -> Path:
    return METRICS / f"compare-{variant}.json"


def decision_metrics(variant: str) -> Path:
    """The short metrics file of one variant (decide writes it; `dvc metrics diff` shows it)."""
    return METRICS / f"{variant}.json"


REPORT = DATA / "report"  # the report stage's figures (PNG) and curves for `dvc plots`; publish adds the timings
REPORT_CURVES = REPORT / "curves"  # one folder per curve family, one flat JSON per variant (dvc.yaml `plots:`)


def report_plot(variant: str, name: str) -> Path:
    return REPORT / "plots" / variant / f"{name}.png"


def report_curve(family: str, variant: str) -> Path:
    return REPORT_CURVES / family / f"{variant}.json"
