"""The "AMP engaged" audit and the FP16 forecast through a real `dvc repro` of the tiny digits project (issue 22):
trial@NAME writes audit.json into its manifest, freeze writes forecast.json into the reference's, diagnose@float16
checks the forecast against the trial, and the verdict says both."""

from __future__ import annotations

import hashlib
import json

import pytest

from conftest import repro_log

pytestmark = pytest.mark.integration


def test_audit_and_forecast_reach_the_manifests_the_diagnosis_and_the_verdict(reproduced, monkeypatch):
    repo = reproduced  # the tiny digits project after `dvc repro` (conftest: examples/sizes/tiny.yaml); read only
    printed = repro_log(repo).read_text()
    data = repo / "data"

    def sha(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for variant in ("float16", "bfloat16"):
        trial = data / "trial" / variant
        manifest = json.loads((trial / "manifest.json").read_text())
        assert manifest["files"]["audit.json"] == sha(trial / "audit.json")  # listed, and what is on disk
        audit = json.loads((trial / "audit.json").read_text())
        assert audit["total"]["reduced_share"] == pytest.approx(1.0, abs=0.02)  # digits' MLP: every matmul reduced
        assert not audit["flagged"] and audit["speedup_claim"] == "supported" and audit["policy"]["dtype"] == variant

    reference = json.loads((data / "reference" / "manifest.json").read_text())
    assert reference["files"]["data/reference/forecast.json"] == sha(data / "reference" / "forecast.json")
    forecast = json.loads((data / "reference" / "forecast.json").read_text())
    assert forecast["recommendation"] == "fp16 is safe" and forecast["worse"] in ("initial", "trained")
    assert forecast["initial"]["batches"] == forecast["trained"]["batches"] == 4

    checked = json.loads((data / "diagnose" / "float16" / "diagnosis.json").read_text())["forecast"]
    assert checked["held"] and checked["recommendation"] == "fp16 is safe" and checked["line"].startswith("forecast held:")
    assert "forecast" not in json.loads((data / "diagnose" / "bfloat16" / "diagnosis.json").read_text())
    assert "FP16 forecast: fp16 is safe" in printed and checked["line"] in printed  # decide's verdict, as dvc repro printed it

    monkeypatch.chdir(repo)  # the renderers read data/ relative to the project, as publish does
    from pipeline.artifacts import variant
    from pipeline.present import page, verdict

    loaded = [variant.load(v) for v in ("float16", "bfloat16")]
    shown = [verdict.text(v) for v in page.verdicts_of(loaded)]
    assert "  audit: AMP engaged: " in shown[0] and "  FP16 forecast: fp16 is safe" in shown[0] and checked["line"] in shown[0]
    assert "  audit: AMP engaged: " in shown[1] and "FP16 forecast" not in shown[1]
