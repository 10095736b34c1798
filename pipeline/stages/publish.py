"""Stage publish: mirror every stage's results to MLflow, once (the DVC outputs stay the source of truth).

One parent run per pipeline execution: its key hashes the reference, the git commit, the params and
the bytes of every mirrored file, so publishing the same results again adds nothing while a rerun that changed
anything (a `dvc exp run`, new benchmark timings) gets a run of its own. Under it, one child run per
stage variant (freeze, trial@DTYPE, compare@DTYPE, ...), tagged so that the runs of one dtype, one
decision or one machine filter together in the MLflow UI.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from pipeline import paths, report, tracking
from pipeline.artifacts import read_json, sha256_file
from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.tracking import RunSpec

PER_DTYPE = ("trial", "compare", "diagnose", "decide", "benchmark")


def main(params_path: str = "params.yaml") -> None:
    started = time.monotonic()
    params = load_params(params_path)
    dtypes = params.trial.dtypes
    _check_fresh(params_path, dtypes)
    manifest = read_json(paths.REF_MANIFEST, "freeze")
    flat = tracking.flatten(asdict(params))
    commit = tracking.git_commit()
    key = hashlib.sha256(json.dumps({
        "reference": manifest["run_key"],
        "rule": manifest["rule_sha256"],
        "commit": commit,
        "params": flat,
        "files": {str(p): sha256_file(p) for p in _mirrored(dtypes)},
    }, sort_keys=True).encode()).hexdigest()

    common = {"git_commit": commit, "mlflow.source.git.commit": commit, "rule_sha256": manifest["rule_sha256"], "reference_run_key": manifest["run_key"]}
    if tracking.dvc_experiment_name():
        common["dvc_experiment"] = tracking.dvc_experiment_name()
    ref_steps = read_json(paths.REF_TRAJECTORY, "freeze")["steps"]
    variants = {d: _variant(d) for d in dtypes}
    children = [_freeze(manifest, ref_steps, common, flat)]
    for d, v in variants.items():
        children += _variant_runs(d, v, ref_steps, common, flat)
    parent = _parent(manifest, variants, common, flat, params_path)
    result = tracking.Publisher(params.tracking.experiment).publish(key, parent, children)
    if result.created:
        print(f"publish: {result.created} run(s) created in {time.monotonic() - started:.1f} s, parent {parent.name!r}: {result.link}")
    else:
        print(f"publish: already published, nothing added: {result.link}")


def _parent(manifest: dict, variants: dict[str, dict], common: dict, flat: dict, params_path: str) -> RunSpec:
    """The pipeline execution: every variant side by side (description, report.html), params, key figures."""
    reference = {k: manifest[k] for k in ("rule_sha256", "run_key", "env", "cases") if k in manifest}
    images = {d: {name: paths.report_plot(d, name).read_bytes() for name, _ in report.PLOTS} for d in variants}
    summary = report.markdown(reference, list(variants.values()))
    verdicts = " ".join(f"{d}={v['decision']['decision']}" for d, v in variants.items())
    return RunSpec(
        name=" ".join(filter(None, [common.get("dvc_experiment"), common["git_commit"][:8], verdicts])),
        tags={**common, **_env_tags(manifest["env"]), "stage": "pipeline", "dtypes": ",".join(variants),
              **{f"decision.{d}": v["decision"]["decision"] for d, v in variants.items()},
              **{f"reasons_count.{d}": str(len(v["decision"]["reasons"])) for d, v in variants.items()}},
        params=flat,
        metrics={f"{d}/{k}": x for d, v in variants.items() for k, x in _key_figures(v).items()},
        artifacts=[(p, "") for p in (Path(params_path), Path("dvc.lock")) if p.is_file()],
        # The report quotes benchmark timings: built here, not as a DVC output (those rerun byte for byte).
        texts={"report.html": report.html(reference, list(variants.values()), images), "summary.md": summary},
        note=summary,
    )


def _mirrored(dtypes: list[str]) -> list[Path]:
    """Every file the runs mirror, in a fixed order; each must exist.

    Raises:
        UserError: a stage output is missing (the pipeline has not run to the end).
    """
    folders = [paths.REFERENCE, paths.REPORT]
    folders += [f(d) for d in dtypes for f in (paths.trial, paths.compare, paths.diagnose, paths.decision, paths.benchmark)]
    files = [paths.compare_metrics(d) for d in dtypes] + [paths.decision_metrics(d) for d in dtypes]
    files += [paths.report_plot(d, name) for d in dtypes for name, _ in report.PLOTS]
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"{folder} not found; run `dvc repro` first, then publish")
        files += [p for p in folder.rglob("*") if p.is_file()]
    for p in files:
        if not p.is_file():
            raise UserError(f"{p} not found; run `dvc repro` first, then publish")
    return sorted(set(files))


def _variant(d: str) -> dict:
    """Every output of one dtype's stages, in the shape ``report`` reads."""
    manifest = read_json(paths.trial(d) / "manifest.json", f"trial@{d}")
    return {
        "dtype": d,
        "env": manifest["env"],
        "manifest": manifest,
        "trajectory": read_json(paths.trial(d) / "trajectory.json", f"trial@{d}"),
        "metrics": read_json(paths.compare_metrics(d), f"compare@{d}"),
        "diagnosis": read_json(paths.diagnose(d) / "diagnosis.json", f"diagnose@{d}"),
        "decision": read_json(paths.decision(d) / "decision.json", f"decide@{d}"),
        "benchmark": read_json(paths.benchmark(d) / "benchmark.json", f"benchmark@{d}"),
    }


def _freeze(manifest: dict, steps: list[dict], common: dict, flat: dict) -> RunSpec:
    return RunSpec(
        name="freeze",
        tags={**common, **_env_tags(manifest["env"]), "stage": "freeze", "dtype": "float32"},
        params=flat,
        metrics={"real_updates": manifest["real_updates"], "final_loss": steps[-1]["loss"], **{f"cases.{k}": n for k, n in manifest["cases"].items()}},
        steps={"loss_fp32": _series(steps, "loss"), "grad_norm_fp32": _series(steps, "grad_norm")},
        artifacts=[(paths.REF_MANIFEST, ""), (paths.REF_TRAJECTORY, "")],
    )


def _variant_runs(d: str, v: dict, ref_steps: list[dict], common: dict, flat: dict) -> list[RunSpec]:
    decision = v["decision"]
    tags = {**common, "dtype": d, "decision": decision["decision"], "reasons_count": str(len(decision["reasons"]))}
    steps = v["trajectory"]["steps"]
    bench = v["benchmark"]
    rollback = paths.decision(d) / "rollback"

    def plot(name: str) -> tuple[Path, str]:
        return paths.report_plot(d, name), "plots"
    return [
        RunSpec(
            name=f"trial@{d}",
            tags={**tags, **_env_tags(v["manifest"]["env"]), "stage": "trial"},
            params=flat,
            metrics={"real_updates": v["manifest"]["real_updates"], "skipped_steps": sum(bool(s["skipped"]) for s in steps), "final_scale": v["trajectory"]["final_scale"]},
            steps={
                "loss_fp32": _series(ref_steps, "loss"),
                "loss_amp": _series(steps, "loss"),
                "loss_scale": _series(steps, "scale"),
                "grad_norm": _series(steps, "grad_norm"),
                "skipped": [(int(s["step"]), float(bool(s["skipped"]))) for s in steps],
                "lr": _series(steps, "lr"),
            },
            artifacts=[(paths.trial(d) / "manifest.json", ""), (paths.trial(d) / "trajectory.json", ""), plot("loss"), plot("scale")],
        ),
        RunSpec(
            name=f"compare@{d}",
            tags={**tags, **_env_tags(v["manifest"]["env"]), "stage": "compare"},
            params=flat,
            metrics=v["metrics"],
            artifacts=[(paths.compare(d) / "stats.json", ""), plot("scores"), plot("errors")],
            tables={"cases.json": read_json(paths.compare(d) / "cases.json", f"compare@{d}")},
        ),
        RunSpec(
            name=f"diagnose@{d}",
            tags={**tags, **_env_tags(v["manifest"]["env"]), "stage": "diagnose"},
            params=flat,
            metrics={"findings": len(v["diagnosis"]["findings"])},
            artifacts=[(paths.diagnose(d) / "diagnosis.json", "")],
            note="\n".join(f"- {f}" for f in v["diagnosis"]["findings"]) or "No finding: nothing non-finite in outputs, loss or gradients.",
        ),
        RunSpec(
            name=f"decide@{d}",
            tags={**tags, **_env_tags(decision.get("env") or v["manifest"]["env"]), "stage": "decide",
                  # the rule itself, so that a later accept under a looser rule can be flagged (decide)
                  **({"rule_json": json.dumps(decision["rule"], sort_keys=True)} if "rule" in decision else {}),
                  **{f"decision_tag.{k}": v for k, v in decision.get("tags", {}).items()}},
            params=flat,
            metrics={"accepted": decision["decision"] == "accept", "reasons": len(decision["reasons"]), "checks": len(decision.get("checks", []))},
            artifacts=[(paths.decision(d) / "decision.json", "")] + [(p, "rollback") for p in sorted(rollback.glob("*")) if p.is_file()],
            note=_decision_note(d, decision),
        ),
        RunSpec(
            name=f"benchmark@{d}",
            tags={**tags, **_env_tags(bench.get("env") or v["manifest"]["env"]), "stage": "benchmark", "benchmarked": str(bool(bench.get("benchmarked"))).lower()},
            params=flat,
            metrics=_bench_metrics(bench),
            artifacts=[(paths.benchmark(d) / "benchmark.json", "")],
            note="" if bench.get("benchmarked") else str(bench.get("reason", "not benchmarked")),
        ),
    ]


def _key_figures(v: dict) -> dict:
    """What the parent shows per dtype, to compare pipeline executions side by side."""
    return {
        "accepted": v["decision"]["decision"] == "accept",
        "reasons": len(v["decision"]["reasons"]),
        **v["metrics"],
        # Medians only (speedup, seconds per step, memory): the spread stays on the benchmark run.
        **{f"benchmark.{k}": x for k, x in _bench_metrics(v["benchmark"]).items() if k.endswith(".median")},
    }


def _bench_metrics(bench: dict) -> dict:
    """Every number benchmark.json holds (strings and sample lists are not metrics and are dropped later)."""
    if not bench.get("benchmarked"):
        return {}
    return tracking.flatten({k: x for k, x in bench.items() if k not in ("env", "benchmarked", "dtype")})


def _env_tags(env: dict) -> dict[str, str]:
    """Where it ran: backend is cpu, cuda or rocm (torch calls a ROCm GPU `cuda`; the stage recorded which)."""
    return {"backend": env.get("backend", "unknown"), "device_name": env.get("device_name", "unknown"), "torch_version": env.get("torch", "unknown")}


def _decision_note(d: str, decision: dict) -> str:
    lines = [f"**{d}: {decision['decision'].upper()}**", ""]
    lines += [f"- {r}" for r in decision["reasons"]] or ["- every criterion of the rule passed"]
    if decision.get("checks"):
        lines += ["", "Passing checks:", ""] + [f"- {c}" for c in decision["checks"]]
    return "\n".join(lines)


def _series(steps: list[dict], field: str) -> list[tuple[int, float]]:
    return [(int(s["step"]), s[field]) for s in steps]


def _check_fresh(params_path: str, dtypes: list[str]) -> None:
    """Refuse to label results with params they were not produced with (params.yaml edited after `dvc repro`).

    Compares the params each mirrored stage recorded in dvc.lock with params.yaml now. Both files are
    read with the YAML 1.2 reader DVC writes the lock with, so numbers compare alike.

    Raises:
        UserError: a param differs: the outputs are stale.
    """
    lock = Path("dvc.lock")
    if Path(params_path).name != "params.yaml" or not lock.is_file():
        return
    from ruamel.yaml import YAML

    yaml = YAML(typ="safe", pure=True)
    current = yaml.load(Path(params_path).read_text()) or {}
    stages = (yaml.load(lock.read_text()) or {}).get("stages", {})
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
