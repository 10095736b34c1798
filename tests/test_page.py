"""The side-by-side table of report.html: rows that exist only for the outputs and training a run has."""

from __future__ import annotations

from pipeline.files import flatten
from pipeline.present import page


def _variant(dtype: str, metrics: dict) -> dict:
    return {
        "variant": dtype, "decision": {"decision": "accept", "reasons": []}, "metrics": metrics, "diagnosis": {}, "benchmark": {},
    }


def test_language_model_rows_show_kl_and_top1_and_the_noise_floor():
    stats = {
        "quality": {"reference": 0.65, "trial": 0.648, "trained": 0.647},
        "distribution": {"kl_mean": 5.9e-7, "kl_p99": 4.1e-6, "kl_max": 2.2e-5, "top1_agreement": 0.9975, "top_k_overlap": 0.99},
        "training": {"max_loss_gap": 0.002, "noise": {
            "max_replicate_gap": 0.042, "mean_replicate_gap": 0.01, "mean_amp_gap": 0.0041, "max_amp_gap": 0.2,
            "multiple": 3.0, "atol": None, "mean_ratio": 0.41,
        }},
    }
    table = dict(page.rows([_variant("float16", flatten(stats))]))
    assert table["distribution: KL(reference || AMP) per token, mean (nats)"] == ["5.9e-07"]
    assert table["distribution: same top-1 token as the reference"] == ["0.9975"]
    assert table["training: FP32 noise floor, largest gap of the replicate (another data order)"] == ["0.042"]
    # What the gate compared (multiple x replicate gap + atol), not a ratio: a replicate gap of 0 made that "inf".
    band = "training: AMP loss gap against the noise band (multiple x replicate gap + atol)"
    assert table[band] == ["mean 0.0041 <= 0.03, max 0.2 > 0.126"]
    stats["training"]["noise"].update(mean_replicate_gap=0.0, max_replicate_gap=0.0, mean_ratio=float("inf"), atol=0.001)
    cells = [c for _, row in page.rows([_variant("float16", flatten(stats))]) for c in row]
    assert "mean 0.0041 > 0.001, max 0.2 > 0.001" in cells and not any("inf" in c for c in cells)


def test_per_sample_classifier_has_no_distribution_rows():
    table = dict(page.rows([_variant("bfloat16", flatten({"quality": {"reference": 0.9}, "training": {}}))]))
    assert not any(label.startswith("distribution:") for label in table)
    assert table["training: FP32 noise floor, largest gap of the replicate (another data order)"] == ["-"]


def test_precision_rows_say_the_audit_share_and_the_forecast_only_where_there_is_one():
    audited = {**_variant("float16", {}), "audit": {"flagged": False, "total": {"reduced_share": None}, "line": "no FLOPs"}}
    checked = {"recommendation": "use bf16", "held": False, "forecast": "use bf16: ...", "line": "missed"}
    audited["diagnosis"] = {"forecast": checked}
    table = dict(page.rows([audited, _variant("bfloat16", {})]))
    assert table["AMP engaged: matmul, convolution and attention FLOPs in reduced precision"] == ["0.0 %", "-"]
    assert table["FP16 forecast (float16 variants)"] == ["use bf16", "-"]
    assert table["FP16 forecast against the trial"] == ["missed", "-"]


def test_masked_classes_get_a_row_only_where_some_were_set_aside():
    values = {"values": {"logits": {"max_abs": 0.01, "zero_probability_both": 0}}}
    label = "'logits': pairs at probability 0 on both sides (masked classes, set aside)"
    assert label not in dict(page.rows([_variant("float16", flatten(values))]))
    masked = {"values": {"logits": {"max_abs": 0.01, "zero_probability_both": 600}}}
    table = dict(page.rows([_variant("float16", flatten(masked)), _variant("bfloat16", flatten(values))]))
    assert table[label] == ["600", "0"]
