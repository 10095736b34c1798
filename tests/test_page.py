"""The side-by-side table of report.html: rows that exist only for the outputs and training a run has.

``blank`` and ``variant`` build the typed records the presenters take (``pipeline.artifacts``), every field a test does
not name zero, empty or None: test_plots, test_verdict, test_runs and test_failed_variant build theirs here too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import replace

from pipeline.artifacts.audit import Audit, Share
from pipeline.artifacts.benchmark import NotBenchmarked
from pipeline.artifacts.comparison import Distribution, Noise, Quality, Stats, Training, ValueGap
from pipeline.artifacts.decision import Decision
from pipeline.artifacts.diagnosis import Diagnosis
from pipeline.artifacts.forecast import ForecastCheck
from pipeline.artifacts.trial import TrialManifest
from pipeline.artifacts.variant import Variant
from pipeline.present import page


def blank(cls, **given):
    """A record of ``cls`` with the ``given`` fields; every other field without a default zero, empty or None."""
    hints = typing.get_type_hints(cls)
    rest = {f.name: _zero(hints[f.name]) for f in dataclasses.fields(cls)
            if f.name not in given and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return cls(**rest, **given)


def _zero(hint):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return None if type(None) in args else _zero(args[0])
    if origin is typing.Literal:
        return args[0]
    if origin in (dict, list, tuple) or hint in (dict, list, tuple):
        return (origin or hint)()
    if dataclasses.is_dataclass(hint):
        return blank(hint)
    return {bool: False, int: 0, float: 0.0, str: ""}.get(hint)


def decided(result: str = "accept", **given) -> Decision:
    """A decision of ``result`` under an empty rule, on the CPU unless ``given`` says otherwise."""
    return blank(Decision, variant=given.pop("variant", "float16"), decision=result, env=given.pop("env", {"backend": "cpu"}),
                 **given)


def variant(name: str, decision: Decision | None = None, **given) -> Variant:
    """One variant's records: an accept, not benchmarked, no diagnosis, a failed trial's (no statistics) unless given;
    ``decision`` as this variant's (its name and policy)."""
    policy = {"dtype": name.split("-")[0]}
    manifest = blank(TrialManifest, policy=policy, env={"backend": "cpu"})
    decision = replace(decision or decided(), variant=name, policy=policy)
    return Variant(name, manifest, decision, given.pop("diagnosis", Diagnosis()),
                   given.pop("benchmark", NotBenchmarked(name, "not benchmarked")), **given)


def test_language_model_rows_show_kl_and_top1_and_the_noise_floor():
    noise = blank(Noise, max_replicate_gap=0.042, mean_replicate_gap=0.01, mean_amp_gap=0.0041, max_amp_gap=0.2, multiple=3.0,
                  atol=None, mean_ratio=0.41)
    stats = blank(
        Stats, quality=blank(Quality, reference=0.65, trial=0.648, trained=0.647),
        distribution=blank(Distribution, kl_mean=5.9e-7, kl_p99=4.1e-6, kl_max=2.2e-5, top1_agreement=0.9975, top_k_overlap=0.99),
        training=blank(Training, max_loss_gap=0.002, noise=noise),
    )
    table = dict(page.rows([variant("float16", stats=stats)]))
    assert table["distribution: KL(reference || AMP) per token, mean (nats)"] == ["5.9e-07"]
    assert table["distribution: same top-1 token as the reference"] == ["0.9975"]
    assert table["training: FP32 noise floor, largest gap of the replicate (another data order)"] == ["0.042"]
    # What the gate compared (multiple x replicate gap + atol), not a ratio: a replicate gap of 0 made that "inf".
    band = "training: AMP loss gap against the noise band (multiple x replicate gap + atol)"
    assert table[band] == ["mean 0.0041 <= 0.03, max 0.2 > 0.126"]
    noise = replace(noise, mean_replicate_gap=0.0, max_replicate_gap=0.0, mean_ratio=float("inf"), atol=0.001)
    stats = replace(stats, training=replace(stats.training, noise=noise))
    cells = [c for _, row in page.rows([variant("float16", stats=stats)]) for c in row]
    assert "mean 0.0041 > 0.001, max 0.2 > 0.001" in cells and not any("inf" in c for c in cells)


def test_per_sample_classifier_has_no_distribution_rows():
    table = dict(page.rows([variant("bfloat16", stats=blank(Stats, quality=blank(Quality, reference=0.9)))]))
    assert not any(label.startswith("distribution:") for label in table)
    assert table["training: FP32 noise floor, largest gap of the replicate (another data order)"] == ["-"]


def test_precision_rows_say_the_audit_share_and_the_forecast_only_where_there_is_one():
    checked = blank(ForecastCheck, recommendation="use bf16", held=False, forecast="use bf16: ...", line="missed")
    audited = variant("float16", audit=blank(Audit, flagged=False, total=blank(Share, reduced_share=None), line="no FLOPs"),
                      diagnosis=Diagnosis(forecast=checked))
    table = dict(page.rows([audited, variant("bfloat16")]))
    assert table["AMP engaged: matmul, convolution and attention FLOPs in reduced precision"] == ["0.0 %", "-"]
    assert table["FP16 forecast (float16 variants)"] == ["use bf16", "-"]
    assert table["FP16 forecast against the trial"] == ["missed", "-"]


def test_masked_classes_get_a_row_only_where_some_were_set_aside():
    def values(zero_probability_both: int) -> Stats:
        return blank(Stats, values={"logits": blank(ValueGap, max_abs=0.01, zero_probability_both=zero_probability_both)})

    label = "'logits': pairs at probability 0 on both sides (masked classes, set aside)"
    assert label not in dict(page.rows([variant("float16", stats=values(0))]))
    table = dict(page.rows([variant("float16", stats=values(600)), variant("bfloat16", stats=values(0))]))
    assert table[label] == ["600", "0"]
