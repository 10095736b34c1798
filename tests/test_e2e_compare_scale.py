"""The real compare stage on a fixed set many times the default holds one chunk of each output, not the files.

``scripts/bench_compare_stage.py`` runs prepare, freeze and trial of the built-in language model at the
default size and at ``scale`` times its ordinary sequences, then ``python -m pipeline compare`` alone in
a launcher that reads its peak RSS. Here at 40x with the default chunk (the README gives the 100x
figures): the scaled outputs are four chunks of every source, four times what the stage may hold.
"""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("bench_compare_stage", ROOT / "scripts" / "bench_compare_stage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_stage_peak_memory_is_bounded_by_one_chunk(tmp_path):
    bench = _script()
    chunk_elements = 4_000_000
    small = bench.measure(tmp_path / "default", 1, chunk_elements)
    big = bench.measure(tmp_path / "x40", 40, chunk_elements)
    chunk_mb = big["one_chunk_of_every_source_mb"]
    assert big["cases"] > 35 * small["cases"] and big["chunk_rows"] * 3 < big["cases"]  # several chunks
    assert sum(big["output_files_mb"].values()) > 3.5 * chunk_mb
    assert big["peak_rss_mb"] - small["peak_rss_mb"] <= 2 * chunk_mb, (small, big)
    assert big["kl_mean"] == pytest.approx(small["kl_mean"], rel=0.5)  # the same model: the same agreement
