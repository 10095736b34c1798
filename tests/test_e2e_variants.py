"""Named variants beyond autocast through a real `dvc repro` (issue 22): torch.compile (inductor, on this CPU with its
C++ compiler) and torchao float8 (emulated on a CPU), judged by the same frozen rule as autocast.

One project, the shipped variants example made small (examples/variants.params.yaml): a model that drifts when
compiled in reduced precision (pipeline/examples/stress.py, DriftNet). The right answers, from the method:
- float32_inductor is the model itself, compiled: nothing moves a decision, it is accepted and benchmarked, its
  compile time reported apart from its step time;
- bfloat16_inductor moves class 0's logit by 4: rolled back, and since the same policy eager passes the rule, the
  diagnosis names compile, not precision;
- float8_tensorwise is judged by the example's stated decision rule: at this size (20 updates, logits still small)
  every value is within it, so it is accepted (the full-size example rolls back one input scaled 100x); its
  manifest says the kernels were emulated, and its benchmark keeps the times but quotes no speedup.
"""

import json

import pytest

from _project import dvc, example
from conftest import make_project

pytestmark = pytest.mark.integration

SMALL = {
    "prepare": {"ordinary_cases": 64},
    "reference": {"train_steps": 20},
    "trial": {"variants": ["float32_inductor", "bfloat16_inductor", "float8_tensorwise"]},
    "bench": {"warmup": 1, "repeats": 3, "steps": 2},
}


def read(repo, path):
    return json.loads((repo / path).read_text())


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    repo = make_project(tmp_path_factory.mktemp("variants") / "repo", _merge(example("variants"), SMALL))
    dvc(repo, "repro", "--glob", "benchmark@*", "report")  # every stage but publish (MLflow is tested elsewhere)
    return repo


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def test_each_variant_gets_the_verdict_the_method_argues(variants):
    decisions = {v: read(variants, f"data/decision/{v}/decision.json") for v in SMALL["trial"]["variants"]}
    assert {v: d["decision"] for v, d in decisions.items()} == {
        "float32_inductor": "accept", "bfloat16_inductor": "rollback", "float8_tensorwise": "accept",
    }, {v: d["reasons"] for v, d in decisions.items()}
    assert decisions["bfloat16_inductor"]["policy"] == {
        "dtype": "bfloat16", "fp32_modules": [], "compile": "inductor", "compile_mode": "default",
    }


def test_the_diagnosis_names_compile_not_precision(variants):
    findings = read(variants, "data/decision/bfloat16_inductor/decision.json")["findings"]
    named = [f for f in findings if f.startswith("compile, not precision, moved the decision")]
    assert named and "the same policy run eager (bfloat16, without torch.compile) passes the rule" in named[0]
    assert "TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1" in named[0]
    diagnosis = read(variants, "data/diagnose/bfloat16_inductor/diagnosis.json")
    assert diagnosis["reruns"][0]["decision"] == "accept"  # the eager re-run, recorded
    assert diagnosis.get("suggestion") is None  # no FP32 region fixes a compiler


def test_the_manifests_say_what_ran(variants):
    float8 = read(variants, "data/trial/float8_tensorwise/manifest.json")
    assert float8["policy"]["float8"] == "tensorwise"
    assert float8["transforms"] == {
        "float8": "tensorwise", "float8_kernels": "emulated", "float8_linears": ["embed", "hidden"],
        "float8_skipped": {"head": "64x4: float8 needs both dims divisible by 16"},
    }
    assert read(variants, "data/trial/float32_inductor/manifest.json")["transforms"] == {"compiled": True}


def test_the_benchmark_reports_compile_apart_and_quotes_no_emulated_speedup(variants):
    compiled = read(variants, "data/benchmark/float32_inductor/benchmark.json")
    assert compiled["benchmarked"] and compiled["compile_seconds"] > 0
    assert compiled["speedup"]["median"] > 0
    float8 = read(variants, "data/benchmark/float8_tensorwise/benchmark.json")
    assert float8["benchmarked"] and "speedup" not in float8 and "emulated" in float8["no_speedup_because"]
    assert float8["seconds_per_step"]["amp"]["median"] > 0  # measured, kept, not quoted
    assert read(variants, "data/metrics/bench-float8_tensorwise.json")["speedup"] is None
    assert not read(variants, "data/benchmark/bfloat16_inductor/benchmark.json")["benchmarked"]  # rolled back
