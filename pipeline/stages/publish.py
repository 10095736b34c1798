"""Stage publish: mirror every stage's results to MLflow, once (the DVC outputs stay the source of truth).

One parent run per pipeline execution: its key hashes the reference, the git commit, the params and
the bytes of every mirrored file, so publishing the same results again adds nothing while a rerun that changed
anything (a `dvc exp run`, new benchmark timings) gets a run of its own.

Under it, ONE child run per dtype, named by its decision ("ROLLBACK bfloat16"), with the decision and the
key figures as metric columns (units in the names), the per-step curves (FP32 and AMP loss, their gap and
the band the rule allows), the figures, the per-case table, the suggested params and the rollback package.
The stages' own JSON outputs ride along as artifacts under ``stages/``: a reviewer compares dtypes and
executions in the runs table, one row per dtype, and opens the details when needed; a run per stage
variant made 12 rows per execution, most of them with nothing to compare.

The stage is ``always_changed`` in dvc.yaml: a fresh clone whose outputs match dvc.lock still publishes,
and publishing what the store already holds is a no-op (a key lookup) that says so. Whether the rule was
loosened after an earlier rollback of the same reference is read here, from the runs published before,
and is said in the verdict and tagged: the decision itself never depends on MLflow.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from pipeline import paths, tracking

from pipeline.present import page

from pipeline.present import verdict

from pipeline import rule
from pipeline.files import read_json, sha256_file
from pipeline.config import DTYPES, ParamsLoader, load_params
from pipeline.errors import UserError
from pipeline.tracking import RunSpec

PER_DTYPE = ("trial", "compare", "diagnose", "decide", "benchmark")


def main(params_path: str = "params.yaml") -> None:
    started = time.monotonic()
    params = load_params(params_path)
    dtypes = params.trial.dtypes
    manifest = read_json(paths.REF_MANIFEST, "freeze")
    flat = tracking.flatten(asdict(params))
    commit = tracking.git_commit()
    key = _key(manifest, commit, flat, dtypes)

    uri = tracking.tracking_uri()
    already = tracking.published_parent(uri, params.tracking.experiment, key)
    if already is not None:  # the common no-op of `dvc repro`: answered without importing MLflow
        variants = {d: _variant(d) for d in dtypes}
        verdicts = [verdict.verdict(d, v["decision"], v["stats"], v["diagnosis"], v["benchmark"], []) for d, v in variants.items()]
        print(f"publish: already published, nothing added; parent run {already.run_link}")
        print(f"publish: {verdict.one_line(verdicts)}; review: {already.link}")
        return
    # Not before the lookup: a key that matches holds these very params, checked when they were published.
    _check_fresh(params_path, dtypes)

    common = {"git_commit": commit, "mlflow.source.git.commit": commit, "rule_sha256": manifest["rule_sha256"], "reference_run_key": manifest["run_key"]}
    if tracking.dvc_experiment_name():
        common["dvc_experiment"] = tracking.dvc_experiment_name()
    variants = {d: _variant(d) for d in dtypes}
    publisher = tracking.Publisher(params.tracking.experiment)
    loosened = {d: _loosened(publisher, manifest["run_key"], v) for d, v in variants.items()}
    verdicts = [verdict.verdict(d, v["decision"], v["stats"], v["diagnosis"], v["benchmark"], loosened[d]) for d, v in variants.items()]
    ref_steps = read_json(paths.REF_TRAJECTORY, "freeze")["steps"]
    parent = _parent(manifest, variants, verdicts, ref_steps, common, flat, params_path)
    children = [_child(d, variants[d], v, loosened[d], ref_steps, common, flat) for d, v in zip(variants, verdicts)]
    result = publisher.publish(key, parent, children)
    for v in verdicts:
        for w in v.warnings:
            print(f"publish: warning: {w}")
    if result.removed:
        print(f"publish: removed {result.removed} duplicate or orphaned run(s) left by concurrent or interrupted publishes")
    done = f"{result.created} run(s) created in {time.monotonic() - started:.1f} s" if result.created else "already published, nothing added"
    print(f"publish: {done}; parent run {result.run_link}")
    print(f"publish: {verdict.one_line(verdicts)}; review: {result.link}")


def _key(manifest: dict, commit: str, flat: dict, dtypes: list[str]) -> str:
    """The execution's key: the reference, the rule, the commit, the params and the bytes of every mirrored
    file of the configured dtypes (a stale file of another dtype, left after `dvc exp apply`, is no part of it)."""
    return hashlib.sha256(json.dumps({
        "reference": manifest["run_key"],
        "rule": manifest["rule_sha256"],
        "commit": commit,
        "params": flat,
        "files": {str(p): sha256_file(p) for p in _mirrored(dtypes)},
    }, sort_keys=True).encode()).hexdigest()


def _loosened(publisher: tracking.Publisher, run_key: str, v: dict) -> list[str]:
    """How the rule of an accept is looser than a rule under which this reference was rolled back before."""
    decision = v["decision"]
    if decision["decision"] != "accept" or "rule" not in decision:
        return []
    out: list[str] = []
    for earlier in publisher.earlier_rollbacks(run_key, v["dtype"]):
        out += [f"{d} (rolled back under rule {earlier['rule_sha256'][:12]})" for d in rule.loosened(earlier["rule"], decision["rule"])]
    return out


def _parent(manifest: dict, variants: dict[str, dict], verdicts: list[verdict.Verdict], ref_steps: list[dict], common: dict, flat: dict, params_path: str) -> RunSpec:
    """The pipeline execution: the verdict block first (description, report.html), the reference, params."""
    reference = {k: manifest[k] for k in ("rule_sha256", "run_key", "env", "cases") if k in manifest}
    images = {d: {name: paths.report_plot(d, name).read_bytes() for name, _ in page.PLOTS if paths.report_plot(d, name).is_file()} for d in variants}
    summary = page.markdown(reference, list(variants.values()), verdicts)
    suffix = " ".join(filter(None, [common.get("dvc_experiment"), common["git_commit"][:8]]))
    return RunSpec(
        name=verdict.run_name(verdicts, suffix),
        tags={**common, **_env_tags(manifest["env"]), "stage": "pipeline", "dtypes": ",".join(variants),
              **{f"decision.{d}": v["decision"]["decision"] for d, v in variants.items()},
              **{f"reasons_count.{d}": str(len(v["decision"]["reasons"])) for d, v in variants.items()}},
        params=flat,
        metrics={"reference.real_updates": manifest.get("real_updates"), "reference.final_loss": ref_steps[-1]["loss"] if ref_steps else None,
                 **{f"{d}.{k}": x for d, v in variants.items() for k, x in _columns(v).items() if k in _PARENT_COLUMNS}},
        steps={"loss_fp32": _series(ref_steps, "loss"), "grad_norm_fp32": _series(ref_steps, "grad_norm")},
        artifacts=[(p, "") for p in (Path(params_path), Path("dvc.lock")) if p.is_file()]
        + [(paths.REF_MANIFEST, "reference"), (paths.REF_TRAJECTORY, "reference")],
        # The report quotes benchmark timings: built here, not as a DVC output (those rerun byte for byte).
        texts={"report.html": page.html(reference, list(variants.values()), images, verdicts), "summary.md": summary},
        note=summary,
    )


_PARENT_COLUMNS = ("accepted", "flips", "near_boundary_flips", "boundary_flips", "max_abs_gap", "quality_trial", "max_loss_gap", "speedup_median", "working_memory_ratio")


def _mirrored(dtypes: list[str]) -> list[Path]:
    """Every file the runs mirror, in a fixed order; each must exist.

    Raises:
        UserError: a stage output is missing (the pipeline has not run to the end).
    """
    folders = [paths.REFERENCE, paths.REPORT, paths.METRICS]
    folders += [f(d) for d in dtypes for f in (paths.trial, paths.compare, paths.diagnose, paths.decision, paths.benchmark)]
    files: list[Path] = []
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"{folder} not found; run `dvc repro` first, then publish")
        files += [p for p in folder.rglob("*") if p.is_file() and not _of_another_dtype(p, dtypes)]
    return sorted(set(files))


def _of_another_dtype(path: Path, dtypes: list[str]) -> bool:
    """A report figure or curve, or a metrics file, of a dtype that is not configured now (what an earlier
    configuration left: `data/report/plots/DTYPE/`, `data/report/curves/FAMILY/DTYPE.json`,
    `data/metrics/DTYPE.json`, `data/metrics/bench-DTYPE.json`)."""
    others = set(DTYPES) - set(dtypes)
    return bool(others & set(path.parts[:-1])) or path.stem in others | {f"bench-{d}" for d in others}


def _variant(d: str) -> dict:
    """Every output of one dtype's stages, in the shape ``report`` and ``review`` read."""
    manifest = read_json(paths.trial(d) / "manifest.json", f"trial@{d}")
    stats = read_json(paths.compare(d) / "stats.json", f"compare@{d}")
    bench_file = paths.benchmark(d) / "benchmark.json"
    return {
        "dtype": d,
        "env": manifest["env"],
        "manifest": manifest,
        "trajectory": read_json(paths.trial(d) / "trajectory.json", f"trial@{d}"),
        "stats": stats,
        "metrics": page.flat(stats),
        "diagnosis": read_json(paths.diagnose(d) / "diagnosis.json", f"diagnose@{d}"),
        "decision": read_json(paths.decision(d) / "decision.json", f"decide@{d}"),
        "benchmark": read_json(bench_file, f"benchmark@{d}") if bench_file.is_file() else {"benchmarked": False, "reason": "benchmark.json not found"},
    }


def _child(d: str, v: dict, review_: verdict.Verdict, loosened: list[str], ref_steps: list[dict], common: dict, flat: dict) -> RunSpec:
    """One dtype: decision and key figures as columns, curves, figures, table, suggestion, rollback package."""
    decision, bench = v["decision"], v["benchmark"]
    steps = v["trajectory"]["steps"]
    rule_ = decision.get("rule") or {}
    tags = {
        **common, **_env_tags(v["manifest"]["env"]), "stage": "variant", "dtype": d, "decision": decision["decision"],
        **{f"decision.{part}": decision[part] for part in ("inference", "training") if part in decision},
        "reasons_count": str(len(decision["reasons"])), "benchmarked": str(bool(bench.get("benchmarked"))).lower(),
        "gradscaler": "on" if (v["stats"].get("training") or {}).get("scaler_enabled") else "off (no GradScaler)",
        # the rule itself, so that a later accept under a looser rule is flagged by publish
        **({"rule_json": json.dumps(rule_, sort_keys=True)} if rule_ else {}),
        **({"rule_loosened": "true"} if loosened else {}),
        **{f"decision_tag.{k}": x for k, x in decision.get("tags", {}).items()},
    }
    artifacts = [(paths.report_plot(d, name), "plots") for name, _ in page.PLOTS if paths.report_plot(d, name).is_file()]
    artifacts.append((paths.decision(d) / "decision.json", ""))
    suggested = paths.diagnose(d) / "suggested_params.yaml"
    if suggested.is_file():
        artifacts.append((suggested, ""))
    artifacts += [(p, "rollback") for p in sorted((paths.decision(d) / "rollback").glob("*")) if p.is_file()]
    for stage, folder in (("trial", paths.trial(d)), ("compare", paths.compare(d)), ("diagnose", paths.diagnose(d)), ("benchmark", paths.benchmark(d))):
        artifacts += [(p, f"stages/{stage}") for p in sorted(folder.glob("*.json")) if p.name != "cases.json"]
    cases = paths.compare(d) / "cases.json"
    return RunSpec(
        name=f"{decision['decision'].upper()} {d}",
        tags=tags,
        params=flat,
        metrics=_columns(v),
        steps=_curves(ref_steps, steps, rule_),
        artifacts=artifacts,
        # flipped cases first: the table opens on them, not after pages of unchanged cases
        tables={"cases.json": sorted(read_json(cases, f"compare@{d}"), key=lambda r: not r.get("flipped"))} if cases.is_file() else {},
        note=verdict.markdown([review_]) + "\n" + _fp64_note(v["stats"]),
    )


def _columns(v: dict) -> dict:
    """The runs table's columns for one dtype: decision, flips, gaps, quality, training, speed and memory."""
    stats, bench = v["stats"], v["benchmark"]
    flips, training, quality = stats.get("flips") or {}, stats.get("training") or {}, stats.get("quality") or {}
    values = (stats.get("values") or {}).values()
    out = {
        "accepted": v["decision"]["decision"] == "accept",
        "reasons": len(v["decision"]["reasons"]),
        "flips": flips.get("flips"),
        "near_boundary_flips": flips.get("near_boundary_flips"),
        "boundary_flips": flips.get("boundary_flips"),
        "max_abs_gap": max((x["max_abs"] for x in values if "max_abs" in x), default=None),
        "failing_fraction": max((x["failing_fraction"] for x in values if "failing_fraction" in x), default=None),
        "quality_reference": quality.get("reference"),
        "quality_trial": quality.get("trial"),
        "quality_trained": quality.get("trained"),
        "max_loss_gap": training.get("max_loss_gap"),
        "loss_band_violations": training.get("band_violations"),
        "skipped_steps": training.get("skipped_steps"),
        "real_updates": training.get("real_updates"),
        "final_loss_scale": training.get("final_scale"),
    }
    distribution = stats.get("distribution") or {}
    for key in ("kl_mean", "kl_p99", "top1_agreement"):  # per-token outputs (language models)
        if distribution.get(key) is not None:
            out[key] = distribution[key]
    for name, arbiter in (stats.get("arbiter") or {}).items():  # renamed: see _fp64_note
        out[f"fp64_check.{name}.amp_error_over_fp32_error"] = arbiter.get("amp_over_fp32")
    if bench.get("benchmarked"):
        def median(*keys: str):
            node = bench
            for k in keys:
                node = node.get(k) if isinstance(node, dict) else None
            return node
        out["speedup_median"] = median("speedup", "median")
        out["memory_ratio_peak"] = median("memory_ratio", "median")
        out["working_memory_ratio"] = median("working_memory_ratio", "median")
        for variant in ("fp32", "amp", "tf32"):
            sec = median("seconds_per_step", variant, "median")
            if sec is not None:
                out[f"step_ms.{variant}"] = 1000 * sec
            for field, label in (("peak_memory_bytes", "process_peak_mib"), ("working_memory_bytes", "working_mib")):
                b = median(field, variant, "median")
                if b is not None:
                    out[f"{label}.{variant}"] = b / 2**20
    return {k: x for k, x in out.items() if x is not None}


def _curves(ref_steps: list[dict], steps: list[dict], rule_: dict) -> dict[str, list[tuple[int, float]]]:
    """Per-step histories: both losses, the AMP gap and the band the rule allows around FP32's loss."""
    ref = {int(s["step"]): s["loss"] for s in ref_steps}
    atol, rtol = rule_.get("loss_atol", 0.0), rule_.get("loss_rtol", 0.0)
    shared = [s for s in steps if int(s["step"]) in ref]
    out = {
        "loss_fp32": _series(ref_steps, "loss"),
        "loss_amp": _series(steps, "loss"),
        "loss_gap_abs": [(int(s["step"]), abs(s["loss"] - ref[int(s["step"])])) for s in shared],
        "loss_band": [(int(s["step"]), atol + rtol * abs(ref[int(s["step"])])) for s in shared],
        "loss_scale": _series(steps, "scale"),
        "grad_norm": _series(steps, "grad_norm"),
        "skipped": [(int(s["step"]), float(bool(s["skipped"]))) for s in steps],
    }
    if steps and "lr" in steps[0]:
        out["lr"] = _series(steps, "lr")
    replicate = getattr(paths, "REF_REPLICATE_TRAJECTORY", None)
    if replicate is not None and Path(replicate).is_file():  # the FP32 noise floor (a one-ulp replicate)
        rep = read_json(replicate, "freeze")["steps"]
        out["loss_noise_floor"] = [(int(s["step"]), abs(s["loss"] - ref[int(s["step"])])) for s in rep if int(s["step"]) in ref]
    return out


def _fp64_note(stats: dict) -> str:
    """What the FP64 check (compare's "arbiter") measures, beside its figure."""
    lines = []
    for name, a in (stats.get("arbiter") or {}).items():
        lines.append(
            f"- FP64 check, output '{name}': against an FP64 re-run of the same inputs, AMP's RMS error is "
            f"{page.number(a.get('amp_rmse_vs_fp64'))} and FP32's own is {page.number(a.get('fp32_rmse_vs_fp64'))}: "
            f"AMP's error is x{page.number(a.get('amp_over_fp32'))} FP32's rounding error. Large by nature "
            f"(float16 keeps 10 mantissa bits, bfloat16 7, float32 23); the tolerances decide, not this ratio."
        )
    return "\n".join(lines)


def _env_tags(env: dict) -> dict[str, str]:
    """Where it ran: backend is cpu, cuda or rocm (torch calls a ROCm GPU `cuda`; the stage recorded which)."""
    return {"backend": env.get("backend", "unknown"), "device_name": env.get("device_name", "unknown"), "torch_version": env.get("torch", "unknown")}


def _series(steps: list[dict], field: str) -> list[tuple[int, float]]:
    return [(int(s["step"]), s[field]) for s in steps if field in s]


def _check_fresh(params_path: str, dtypes: list[str]) -> None:
    """Refuse to label results with params they were not produced with (params.yaml edited after `dvc repro`).

    Compares the params each mirrored stage recorded in dvc.lock with params.yaml now. Both files are
    read as the stages read params.yaml (``config.ParamsLoader``: YAML 1.2 numbers, as DVC writes them).

    Raises:
        UserError: a param differs: the outputs are stale.
    """
    lock = Path("dvc.lock")
    if Path(params_path).name != "params.yaml" or not lock.is_file():
        return
    current = yaml.load(Path(params_path).read_text(), Loader=ParamsLoader) or {}
    stages = (yaml.load(lock.read_text(), Loader=ParamsLoader) or {}).get("stages", {})
    mirrored = {"prepare", "freeze", "report"} | {f"{s}@{d}" for s in PER_DTYPE for d in dtypes}
    for name in sorted(mirrored & set(stages)):
        for key, recorded in ((stages[name].get("params") or {}).get("params.yaml") or {}).items():
            now = current
            for part in key.split("."):
                now = now.get(part) if isinstance(now, dict) else None
            if now != recorded:
                raise UserError(
                    f"params.yaml {key} changed since stage {name} produced its outputs; run `dvc repro` first so that "
                    f"what is published matches the params it is labelled with"
                )
