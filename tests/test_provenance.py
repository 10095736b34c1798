"""Provenance (pipeline/provenance.py): the repository, the publish key."""

from __future__ import annotations

import pytest

from pipeline import provenance
from pipeline.errors import UserError


def test_the_publish_key_ignores_files_of_dtypes_no_longer_configured(tmp_path, monkeypatch):
    from pipeline import provenance

    monkeypatch.chdir(tmp_path)
    for rel in ("data/reference/manifest.json", "data/report/plots/float16/loss.png", "data/report/curves/loss/float16.json",
                "data/metrics/float16.json", "data/metrics/bench-float16.json",
                *(f"data/{stage}/float16/x.json" for stage in ("trial", "compare", "diagnose", "decision", "benchmark"))):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    before = provenance.publish_key("r", "s", "c", {}, ["float16"])
    # What a `dvc exp apply` of an earlier experiment with both dtypes leaves behind:
    for rel in ("data/report/plots/bfloat16/loss.png", "data/report/curves/loss/bfloat16.json", "data/metrics/bfloat16.json",
                "data/metrics/bench-bfloat16.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("stale")
    assert provenance.publish_key("r", "s", "c", {}, ["float16"]) == before
    (tmp_path / "data/metrics/float16.json").write_text("changed")
    assert provenance.publish_key("r", "s", "c", {}, ["float16"]) != before  # a file of a configured dtype still counts


def test_params_dvc_lock_records_as_text_are_the_params_yaml_text(tmp_path, monkeypatch):
    """DVC (YAML 1.2) writes the text '12:30' unquoted in dvc.lock; read as YAML 1.1 it was the number 750, and publish
    refused fresh results as made with other params."""
    from dvc.utils.serialize import dumps_yaml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("tracking: {experiment: '12:30'}\n")
    lock = {"schema": "2.0", "stages": {"report": {"params": {"params.yaml": {"tracking.experiment": "12:30"}}}}}
    (tmp_path / "dvc.lock").write_text(dumps_yaml(lock))
    assert "experiment: 12:30" in (tmp_path / "dvc.lock").read_text()
    provenance.check_fresh("params.yaml", ["float16"])  # no "changed since" refusal
    (tmp_path / "params.yaml").write_text("tracking: {experiment: '12:31'}\n")
    with pytest.raises(UserError, match="tracking.experiment changed since stage report"):
        provenance.check_fresh("params.yaml", ["float16"])
