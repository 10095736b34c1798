"""Figures, report and DVC plots: deterministic bytes, complete content, and `dvc plots show` rendering them."""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from _project import ROOT, dvc, stage, write_params
from _steps import step

from dataclasses import replace

from test_page import blank, decided, variant

from pipeline.artifacts.audit import Audit, AuditedOp, Share
from pipeline.artifacts.benchmark import Benchmark, Interval, MemorySummary, NotBenchmarked, Speed, Spread
from pipeline.artifacts.comparison import Decisions, Flip, Quality, Stats, Training, ValueGap
from pipeline.artifacts.diagnosis import Diagnosis, Suggestion
from pipeline.artifacts.forecast import ForecastCheck
from pipeline.artifacts.reference import Manifest
from pipeline.artifacts.steps import StepRecord
from pipeline.config import AcceptanceConfig
from pipeline.present import page, plots, verdict

DTYPES = ("float16", "bfloat16")


def synthetic() -> tuple[list[StepRecord], dict[str, list[StepRecord]], dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """A reference and two trials: one with skipped steps and a non-finite loss, one with exact outputs."""
    ref_steps = [step(i, 2.0 / (1 + i)) for i in range(20)]
    fp16 = [step(i, math.inf if i == 3 else 2.0 / (1 + i) + 0.01, scale=65536.0 / 2 ** (i // 7), skipped=i in (7, 14))
            for i in range(20)]
    bf16 = [step(i, 2.0 / (1 + i) - 0.02) for i in range(20)]
    gen = np.random.default_rng(0)
    ref = {"output": gen.normal(size=(50, 10)).astype(np.float32), "aux": gen.normal(size=(50, 1)).astype(np.float32) * 100}
    trial = {
        "float16": {k: (v + gen.normal(scale=1e-3, size=v.shape)).astype(np.float32) for k, v in ref.items()},
        "bfloat16": {k: v.copy() for k, v in ref.items()},
    }
    trial["float16"]["output"][0, 0] = np.nan
    return ref_steps, {"float16": fp16, "bfloat16": bf16}, ref, trial


def render_all() -> dict[str, bytes]:
    ref_steps, steps, ref, trial = synthetic()
    out = {}
    for d in DTYPES:
        out[f"{d}/loss"] = plots.loss_curves(ref_steps, steps[d], d)
        out[f"{d}/scale"] = plots.loss_scale(steps[d], d)
        out[f"{d}/envelope"] = plots.error_envelope(
            ref, trial[d], {"output": (0.05, 0.01), "aux": (0.5, 0.0)}, d, np.arange(50) % 7 == 0
        )
        out[f"{d}/errors"] = plots.error_histogram(ref, trial[d], {"output": 0.05, "aux": 0.5}, d)
    return out


def digests(figures: dict[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in figures.items()}


def variants(images: dict[str, dict[str, bytes]] | None = None) -> list:
    """An accept slower than FP32, a rollback with flips and a suggestion, an accept faster than FP32 (typed records)."""
    accept = decided("accept", checks=["training: every loss finite"], rule={"boundary_margin": 0.05})
    rollback = decided("rollback", reasons=["values 'output': 3 of 10 <outside> | atol"], inference="rollback",
                       findings=["first non-finite loss at step 3"], rule={"boundary_margin": 0.05})
    flip = blank(Flip, id="ordinary/digits-1274", kind="ordinary", boundary=False, near_boundary=True, reference_class=5,
                 trial_class=2, reference_margin=0.037, trial_margin=0.01)
    built = blank(Flip, id="boundary/a~b", kind="boundary", boundary=True, near_boundary=False, reference_class=1,
                  trial_class=7, reference_margin=0.0002, trial_margin=0.001)
    stats = blank(
        Stats, flips=blank(Decisions, flips=0, near_boundary_flips=1, near_boundary_cases=3, boundary_flips=1, boundary_cases=4,
                           boundary_margin=0.05, flip_list=(built, flip)),
        quality=blank(Quality, reference=0.9, trial=0.89), values={"output": blank(ValueGap, max_abs=0.01, atol=0.05, rtol=0.0)},
        training=blank(Training, steps=20, max_loss_gap=0.01, band_violations=0, scaler_enabled=False, final_scale=1.0,
                       skipped_fraction=0.0),
    )
    aa = Interval(median=1.0, low=0.97, high=1.03, level=0.95, coverage=0.96, n=9)
    bench = blank(Benchmark, variant="float16-fast", env={"backend": "cpu"}, speedup=blank(Spread, median=1.5, q1=1.4, q3=1.6),
                  speed=Speed("faster", replace(aa, median=1.5, low=1.41, high=1.62), aa, "m"),
                  seconds_per_step={"fp32": blank(Spread, median=0.3), "amp": blank(Spread, median=0.2)},
                  memory=blank(MemorySummary, working_memory_ratio=blank(Spread, median=0.5)))
    slow = replace(bench, variant="float16", speedup=blank(Spread, median=0.32, q1=0.3, q3=0.34),
                   speed=Speed("slower", replace(aa, median=0.32, low=0.3, high=0.35), aa, "m"))
    diagnosis = Diagnosis(findings=["first non-finite loss at step 3"],
                          suggestion=Suggestion(fp32_modules=("head", "0"), rule_passes=True, file=""))
    images = images or {}
    return [
        variant("float16", accept, stats=stats, benchmark=slow, plots=images.get("float16", {})),
        variant("bfloat16", rollback, stats=stats, diagnosis=diagnosis,
                benchmark=NotBenchmarked("bfloat16", "bfloat16 was rolled back"), plots=images.get("bfloat16", {})),
        variant("float16-fast", accept, stats=stats, benchmark=bench, plots=images.get("float16-fast", {})),
    ]


SLOW = "x0.32 (3.1 times slower; 95 % interval 0.30-0.35; FP32 against itself 0.97-1.03)"
FAST = "x1.50 faster (95 % interval 1.41-1.62; FP32 against itself 0.97-1.03)"
"""The speed words of ``variants()``' benchmarks: their verdict, interval and FP32 against itself."""

REFERENCE = blank(Manifest, rule_sha256="ab" * 32, run_key="cd" * 32,
                  env={"backend": "cpu", "device_name": "x86_64", "torch": "2.13.0"}, cases={"total": 50, "ordinary": 50})
"""A reference frozen before the role table (``roles`` empty)."""


@pytest.fixture(scope="module")
def figures() -> dict[str, bytes]:
    return render_all()


def test_figures_are_identical_bytes_in_one_process_and_across_processes(figures):
    ref_steps, steps, ref, trial = synthetic()
    first = figures
    # Again in this process (state left behind by earlier figures must not leak in), then in a fresh one.
    assert plots.loss_curves(ref_steps, steps["float16"], "float16") == first["float16/loss"]
    assert plots.error_histogram(ref, trial["bfloat16"], {"output": 0.05, "aux": 0.5}, "bfloat16") == first["bfloat16/errors"]
    script = "import json, test_plots; print(json.dumps(test_plots.digests(test_plots.render_all())))"
    # scripts: _project
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")])})
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == digests(first)
    for name, png in first.items():
        assert png.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert b"Software" not in png and b"matplotlib" not in png.lower(), name


def test_curve_rows_are_long_records_titled_and_coloured_per_dtype_and_series():
    ref_steps, steps, _, _ = synthetic()
    band = AcceptanceConfig(loss_atol=0.05, loss_rtol=0.1)
    rows = plots.curve_rows(ref_steps, steps["float16"], "float16", band=band, noise_steps=ref_steps[:3])
    assert set(rows) == {"loss", "scale"}
    first = [r for r in rows["loss"] if r["step"] == 0]
    assert {r["series"]: r["value"] for r in first} == pytest.approx({
        "FP32 reference": 2.0, "AMP float16": 2.01, "|AMP float16 - FP32|": 0.01, "band allowed by the rule": 0.05 + 0.1 * 2.0,
        "FP32 noise floor": 0.0})
    assert {r["panel"] for r in first} == {"loss", "gap"} and {r["dtype"] for r in rows["loss"]} == {"float16"}
    # inf: a gap, valid JSON
    assert [r for r in rows["loss"] if r["step"] == 3 and r["series"] == "AMP float16"][0]["value"] is None
    assert [r["skipped"] for r in rows["scale"]].count(1) == 2
    assert {r["series"] for r in plots.curve_rows(ref_steps, steps["bfloat16"], "bfloat16")["scale"]} == {
        "no GradScaler: scale fixed at 1"
    }


def test_verdict_block_comes_first_with_flips_gain_and_next_commands(figures):
    images = {d: {k.split("/")[1]: v for k, v in figures.items() if k.startswith(d)} for d in DTYPES}
    doc = page.html(REFERENCE, variants(images))
    assert (
        doc.index('<section id="verdict">') < doc.index('<table class="summary">') < doc.index("<footer>")
        < doc.index(REFERENCE.rule_sha256)
    )
    # what a reader sees
    verdict = html.unescape(re.sub(r"<[^>]+>", "", doc[doc.index('<section id="verdict">'):doc.index("</section>")]))
    assert f"float16: ACCEPT: the rule passed, {SLOW} on the benchmark's CPU" in verdict and "keep FP32 there" in verdict
    assert (f"float16-fast: ACCEPT: the rule passed, {FAST} on the benchmark's CPU, working memory x0.50: "
            "switch to AMP there") in verdict
    assert "bfloat16: ROLLBACK: 1 criterion failed (inference ROLLBACK, training ACCEPT); keep FP32 for bfloat16" in verdict
    assert "ordinary/digits-1274: class 5 -> 2, reference margin 0.037 (trial 0.01) - a REAL sample near the boundary" in verdict
    assert verdict.index("ordinary/digits-1274") < verdict.index("boundary/a~b: class 1 -> 7")  # real samples first
    assert "a constructed boundary case" in verdict
    suggested = """dvc exp run -S 'trial.policies.bfloat16.fp32_modules=["head","0"]' -S 'trial.variants=[bfloat16]'"""
    # the useful next step first (issue 51, friction 6), then the restore; the box wraps instead of cutting them off
    assert verdict.index(suggested) < verdict.index("python -m pipeline restore --variant bfloat16")
    assert re.search(r"pre\{[^}]*white-space:pre-wrap;overflow-wrap:anywhere", doc) and "<pre>dvc exp run" in doc
    assert "no GradScaler" in verdict
    md = page.markdown(REFERENCE, variants())
    assert md.index("## Verdict") < md.index("## Key figures") < md.index(REFERENCE.rule_sha256)
    assert md.splitlines()[:3] == [
        f"**float16: ACCEPT** - the rule passed, {SLOW} on the benchmark's CPU, working memory x0.50: "
        "keep FP32 there unless memory is what you lack  ",
        "**bfloat16: ROLLBACK** - 1 criterion failed (inference ROLLBACK, training ACCEPT); keep FP32 for bfloat16 "
        "(the reference state is restorable exactly); "
        f"next: `{suggested}`  ",
        f"**float16-fast: ACCEPT** - the rule passed, {FAST} on the benchmark's CPU, working memory x0.50: switch to AMP there",
    ]


ENGAGED = blank(Audit, flagged=False, total=blank(Share, reduced_share=0.994),
                line="AMP engaged: 99.4 % of the matmul, convolution and attention FLOPs ran in reduced precision "
                     "(float16 99.4 %)")
BARELY = blank(Audit, flagged=True, total=blank(Share, reduced_share=0.02),
               line="AMP did not engage: only 2.0 % ...; speedup claim unsupported",
               stayed_fp32=(blank(AuditedOp, op="aten.mm.default", shapes=((64, 8), (8, 64)), precision="float64", module="",
                                  phase="forward", share=0.98),))
CHECKED = ForecastCheck(recommendation="fp16 is safe", forecast="fp16 is safe: largest activation 12.3 (module '2')", held=True,
                        expected="finite outputs", observed="skipped 0",
                        line="forecast held: expected finite outputs; the trial ...")


def test_verdict_says_the_audit_and_the_forecast_and_a_flagged_audit_unsupports_the_speedup():
    fp16, bf16, fast = variants()
    fp16 = replace(fp16, audit=ENGAGED, diagnosis=Diagnosis(forecast=CHECKED))
    bf16, fast = replace(bf16, audit=ENGAGED), replace(fast, audit=BARELY)
    doc = page.html(REFERENCE, [fp16, bf16, fast])
    shown = html.unescape(re.sub(r"<[^>]+>", "", doc[doc.index('<section id="verdict">'):doc.index("</section>")]))
    assert ("float16-fast: ACCEPT: the rule passed, speedup claim unsupported: autocast barely engaged (share 2.0 %); "
            f"the benchmark measured {FAST}") in shown and "switch to AMP there" not in shown
    assert f"audit: {ENGAGED.line}" in shown and f"audit: {BARELY.line}" in shown
    assert f"FP16 forecast: {CHECKED.forecast}" in shown and CHECKED.line in shown
    assert shown.count("FP16 forecast:") == 1  # float16 only: the others have no check
    text = verdict.text(verdict.verdict("float16", fp16.decision, fp16.stats, fp16.diagnosis, fp16.benchmark, audit=ENGAGED))
    lines = text.splitlines()
    assert lines.index(f"  audit: {ENGAGED.line}") < lines.index(f"  FP16 forecast: {CHECKED.forecast}") < lines.index(
        f"  {CHECKED.line}")
    assert SLOW in lines[0]  # an engaged audit leaves the measured gain as it was
    # The variant's section lists what stayed in FP32 unasked, and the table says the share and the flag.
    assert "aten.mm.default [64,8] x [8,64] float64 in the model's own code (forward), 98.0 % of the FLOPs" in html.unescape(doc)
    table = dict(page.rows([fp16, bf16, fast]))
    engaged = "AMP engaged: matmul, convolution and attention FLOPs in reduced precision"
    assert table[engaged] == ["99.4 %", "99.4 %", "2.0 %, FLAGGED: speedup claim unsupported"]
    assert table["FP16 forecast (float16 variants)"] == ["fp16 is safe", "-", "-"]
    assert table["FP16 forecast against the trial"] == ["held", "-", "-"]
    md = verdict.markdown([verdict.verdict("float16-fast", fast.decision, benchmark=fast.benchmark, audit=BARELY)])
    assert "speedup claim unsupported: autocast barely engaged (share 2.0 %)" in md


@pytest.mark.integration
def test_report_stage_reproduces_its_dvc_outputs_byte_for_byte(reproduced, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    folder = repo / "data" / "report"
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".gitignore"}
    assert {str(p) for p in before} >= {f"plots/{d}/{n}.png" for d in DTYPES for n in ("loss", "scale", "envelope", "errors")}
    shutil.rmtree(folder)
    proc = stage(repo, "report")
    assert proc.returncode == 0, proc.stderr
    after = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".gitignore"}
    assert after.keys() == before.keys()
    assert [str(k) for k in before if before[k] != after[k]] == []


def with_templates(repo) -> None:
    """The plot templates and the offline page, as the repository ships them in .dvc/ (tests build bare projects)."""
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots", dirs_exist_ok=True)
    dvc(repo, "config", "plots.html_template", "plots/offline.html")


@pytest.mark.integration
def test_dvc_metrics_are_short_and_plots_render_offline_titled_per_dtype(reproduced, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    with_templates(repo)
    shown = json.loads(dvc(repo, "metrics", "show", "--json").stdout)
    metrics = next(iter(shown.values()))["data"]
    assert not any("compare" in path for path in metrics), "compare's big JSON is not a metric any more"
    for d in DTYPES:
        short = metrics[f"data/metrics/{d}.json"]["data"]
        assert short["decision"] in ("accept", "rollback") and len(short) <= 10, short
        words = {k: v for k, v in short.items() if isinstance(v, str)}
        assert set(words) == {"decision"} and set(words.values()) <= {"accept", "rollback"}, short  # the parts: decision.json
        assert all(isinstance(v, (int, float)) for k, v in short.items() if k not in words), short  # no other text, no quantiles
    table = dvc(repo, "metrics", "show").stdout
    print(f"\n`dvc metrics show` is {max(len(line) for line in table.splitlines())} columns wide:\n{table}")
    out = tmp_path / "plots"
    dvc(repo, "plots", "show", "-o", str(out))
    doc = (out / "index.html").read_text()
    assert not re.search(r"<script[^>]+src=", doc), "a script would load from the network: blank when offline"
    assert doc.count("vegaEmbed(") >= 4 and "Training loss per step and AMP" in doc
    for family in ("loss", "scale"):
        for d in DTYPES:
            assert f'id = "data_report_curves_{family}_{d}_json"' in doc, (family, d)
    # coloured per series
    for series in ("FP32 reference", "AMP float16", "FP32 noise floor", "no GradScaler: scale fixed at 1"):
        assert re.search(rf'"series":\s*"{re.escape(series)}"', doc), series


@pytest.mark.integration
def test_one_dtype_leaves_no_stale_figures_and_plots_still_render(reproduced, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    with_templates(repo)
    write_params(repo, {"trial": {"variants": ["bfloat16"]}})
    dvc(repo, "repro", "--single-item", "report")  # only this stage; dvc.lock then lists only bfloat16 files
    assert not (repo / "data/report/plots/float16").exists()
    assert not (repo / "data/report/curves/loss/float16.json").exists()
    rendered = json.loads(dvc(repo, "plots", "show", "--json").stdout)
    ids = set(rendered.get("data", rendered))
    assert any("bfloat16" in i for i in ids) and not any("/float16" in i for i in ids), ids
    assert "errors" not in rendered or not rendered["errors"], rendered.get("errors")


@pytest.mark.parametrize("steps", [[], [step(0, math.nan, scale=math.nan, skipped=True)]])
def test_degenerate_curves_still_render(steps):
    assert plots.loss_curves(steps, steps, "float16").startswith(b"\x89PNG")
    assert plots.loss_scale(steps, "float16").startswith(b"\x89PNG")


@pytest.mark.integration
def test_plots_diff_between_revisions_needs_no_dvc_cache(reproduced, tmp_path):
    """`dvc plots diff main EXP` from a fresh clone: the curves are in git (cache: false), not only in the cache."""
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    with_templates(repo)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "reproduced"], cwd=repo, check=True)
    dvc(repo, "exp", "run", "-n", "bf16", "-S", "trial.variants=[bfloat16]")  # reruns report (and publish) only
    branch = subprocess.run(
        ["git", "branch", "--show-current"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    shutil.rmtree(repo / ".dvc" / "cache")  # what a fresh clone has: git, no DVC cache
    rendered = json.loads(dvc(repo, "plots", "diff", branch, "bf16", "--json").stdout)
    assert not rendered.get("errors"), rendered.get("errors")
    data = rendered.get("data", rendered)
    loss = [entry for key, entries in data.items() if "loss/bfloat16" in key for entry in entries]
    revs = {r["rev"] for entry in loss for r in (entry.get("content", {}).get("data", {}).get("values") or [])}
    assert {branch, "bf16"} <= revs, revs


def test_report_stage_reads_a_bounded_sample_of_large_outputs(tmp_path, monkeypatch):
    """Past MAX_ELEMENTS (a language model's logits), the figures read evenly spaced cases plus every flipped
    one, slice by slice, never the whole file; below it, every case."""
    from safetensors.numpy import save_file

    from pipeline.artifacts import outputs, report

    gen = np.random.default_rng(0)
    full = {"logits": gen.normal(size=(1000, 4, 8)).astype(np.float32), "aux": gen.normal(size=(1000, 1)).astype(np.float32)}
    path = tmp_path / "outputs.safetensors"
    save_file(full, str(path), metadata={"ids": json.dumps([f"c{i}" for i in range(1000)])})
    reader = outputs.NumpyReader(path, hashlib.sha256(path.read_bytes()).hexdigest(), "freeze")
    ids, per_case = reader.ids, reader.elements_per_case
    assert ids[:2] == ["c0", "c1"] and per_case == 33
    whole = report.sample(ids, per_case, {"c3"})
    assert whole.rows is None and whole.note == "" and whole.flipped.tolist() == [i == 3 for i in range(1000)]
    monkeypatch.setattr(report, "MAX_ELEMENTS", 33 * 100)
    drawn = report.sample(ids, per_case, {"c3", "c998"})
    rows, note = drawn.rows, drawn.note
    assert 100 <= len(rows) <= 102 and {0, 3, 998, 999} <= set(rows.tolist()) and list(rows) == sorted(set(rows.tolist()))
    assert note == f"{len(rows)} of 1000 cases drawn (evenly spaced, every flipped one)"
    assert drawn.flipped.tolist() == np.isin(rows, [3, 998]).tolist()
    part = reader.read(rows)
    for name, value in full.items():
        np.testing.assert_array_equal(part[name], value[rows])
    png = plots.error_envelope(
        part, {k: v + 1e-3 for k, v in part.items()}, {"logits": (1e-4, 0.0)}, "float16", np.isin(rows, [3, 998]), note
    )
    assert png.startswith(b"\x89PNG")


def test_the_report_and_the_mlflow_description_show_the_role_table() -> None:
    """Freeze's role table (``heads.Roles``, in the reference manifest) is shown beside the verdict: a reviewer sees
    how each output was judged, and which roles were stated."""
    from pipeline import heads
    from pipeline.config import AcceptanceConfig, Tolerance
    rule = AcceptanceConfig(outputs={"*": Tolerance(), "aux": Tolerance(role="values")})
    roles = heads.resolve("classification", rule, {"logits": (8, 10), "aux": (8, 3)}, "logits", threshold=None,
                          over_positions=[], probabilities={}, scales={"logits": 4.7})
    reference = replace(REFERENCE, roles=roles.as_dict())
    md, doc = page.markdown(reference, variants()), page.html(reference, variants())
    assert "## Outputs, as judged" in md and "| logits (primary) | 10 | classes (inferred) | argmax over classes |" in md
    assert "| aux | 3 | values (stated) | - |" in md
    assert "<h2>Outputs, as judged</h2>" in doc and "<td>values (stated)</td>" in doc
    assert "Outputs, as judged" not in page.markdown(REFERENCE, variants())  # a reference frozen before roles: no table
