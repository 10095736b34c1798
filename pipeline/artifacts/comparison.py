"""The compare artifact of one dtype (``data/compare/<dtype>/``): written here, read back here.

Files: ``stats.json`` (every statistic: what decide applies the rule to), ``cases.json`` (the per-case
table: every flipped case and the ``compare.table_rows`` worst others) and ``summary.json`` (flat
numbers; not a DVC metric: decide's short metrics file is). compare writes them with ``write``; decide, diagnose, report and
publish read them with ``read`` / ``read_table`` and the typed accessors of ``Stats``, never by key
paths of their own. Torch-free (decide reads it without importing torch).

API:
    write(dtype, stats: dict, table: list[dict]) -> None
    read(dtype) -> Stats                 raises UserError when compare@DTYPE has not run
    read_table(dtype) -> list[dict]
    summary(stats: dict) -> dict         flat numbers (MLflow), also written as summary.json
    Stats.raw                            the whole dict (what ``verdict.decide`` takes)
    Stats.values / .flips / .quality / .training / .distribution / .arbiter / .regression   sections (dicts)
    Stats.real_flips, .near_boundary_flips, .boundary_flips, .boundary_cases, .flip_ids(), .per_token
    Stats.max_abs_gap, .quality_reference, .quality_trial, .quality_trained, .max_loss_gap
    Stats.kl_mean, .kl_p99, .kl_max, .top1_agreement (None unless per-token outputs)
    Stats.noise (per-step FP32 replicate gap beside AMP's, or None)
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import paths
from pipeline.files import read_json, write_json

STATS = "stats.json"
TABLE = "cases.json"
SUMMARY = "summary.json"


@dataclass(frozen=True)
class Stats:
    """Typed view of compare's ``stats.json``."""

    raw: dict

    @property
    def values(self) -> dict[str, dict]:
        """Per named output: elements, failing, max/mean/p99 abs and rel error, min passing atol/rtol, per_kind."""
        return self.raw["values"]

    @property
    def flips(self) -> dict:
        return self.raw["flips"]

    @property
    def quality(self) -> dict:
        """metric, higher_is_better, reference, trial, trained (and perplexity for per-token outputs)."""
        return self.raw["quality"]

    @property
    def training(self) -> dict:
        return self.raw["training"]

    @property
    def distribution(self) -> dict | None:
        """Per-token outputs: tokens, kl_mean, kl_p99, kl_max, top1_agreement, top_k, top_k_overlap."""
        return self.raw.get("distribution")

    @property
    def arbiter(self) -> dict | None:
        return self.raw.get("arbiter")

    @property
    def regression(self) -> dict | None:
        return self.raw.get("regression")

    @property
    def per_token(self) -> bool:
        return self.flips.get("unit") == "token"

    @property
    def real_flips(self) -> int:
        """Flips of real cases (ordinary, edge), near the boundary or not."""
        return int(self.flips["flips"]) + int(self.flips.get("near_boundary_flips", 0))

    @property
    def near_boundary_flips(self) -> int:
        return int(self.flips.get("near_boundary_flips", 0))

    @property
    def boundary_flips(self) -> int:
        return int(self.flips["boundary_flips"])

    @property
    def boundary_cases(self) -> int:
        return int(self.flips["boundary_cases"])

    def flip_ids(self, boundary: bool | None = None) -> list[str]:
        """Ids of the listed flips (per token: ``id@position``); ``boundary`` filters constructed boundary cases."""
        return [f["id"] + (f"@{f['position']}" if "position" in f else "") for f in self.flips["flip_list"]
                if boundary is None or bool(f["boundary"]) == boundary]

    @property
    def max_abs_gap(self) -> float:
        return max((g["max_abs"] for g in self.values.values()), default=0.0)

    @property
    def quality_reference(self) -> float:
        return self.quality["reference"]

    @property
    def quality_trial(self) -> float:
        return self.quality["trial"]

    @property
    def quality_trained(self) -> float:
        return self.quality["trained"]

    @property
    def max_loss_gap(self) -> float:
        return self.training["max_loss_gap"]

    @property
    def noise(self) -> dict | None:
        return self.training.get("noise")

    def _dist(self, key: str) -> float | None:
        return self.distribution[key] if self.distribution else None

    @property
    def kl_mean(self) -> float | None:
        return self._dist("kl_mean")

    @property
    def kl_p99(self) -> float | None:
        return self._dist("kl_p99")

    @property
    def kl_max(self) -> float | None:
        return self._dist("kl_max")

    @property
    def top1_agreement(self) -> float | None:
        return self._dist("top1_agreement")


def summary(stats: dict) -> dict:
    """Flat numbers for `dvc metrics show` and MLflow."""
    out: dict[str, float | int] = {}
    for name, g in stats["values"].items():
        for key in ("max_abs", "p99_abs", "max_rel", "failing_fraction", "nonfinite_trial_only", "min_passing_atol"):
            out[f"values.{name}.{key}"] = g[key]
    if stats.get("arbiter"):
        for name, a in stats["arbiter"].items():
            out[f"arbiter.{name}.amp_over_fp32"] = a["amp_over_fp32"]
    for key in ("flips", "near_boundary_flips", "boundary_flips", "boundary_cases"):
        out[f"decisions.{key}"] = stats["flips"].get(key, 0)
    for key in ("reference", "trial", "trained"):
        out[f"quality.{key}"] = stats["quality"][key]
    if stats.get("distribution"):
        for key in ("kl_mean", "kl_p99", "kl_max", "top1_agreement", "top_k_overlap"):
            out[f"distribution.{key}"] = stats["distribution"][key]
    for key in ("max_loss_gap", "band_violations", "skipped_fraction", "real_updates", "final_scale", "final_loss_reference", "final_loss_trial"):
        out[f"training.{key}"] = stats["training"][key]
    return out


def write(dtype: str, stats: dict, table: list[dict]) -> None:
    out = paths.compare(dtype)
    write_json(out / STATS, stats)
    write_json(out / TABLE, table)
    write_json(out / SUMMARY, summary(stats))


def read(dtype: str) -> Stats:
    """Raises: UserError when compare@DTYPE has not run."""
    return Stats(read_json(paths.compare(dtype) / STATS, f"compare@{dtype}"))


def read_table(dtype: str) -> list[dict]:
    return read_json(paths.compare(dtype) / TABLE, f"compare@{dtype}")
