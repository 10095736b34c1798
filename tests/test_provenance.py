"""Provenance (pipeline/provenance.py): the repository, the publish key."""

from __future__ import annotations


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
