"""The verdict in words (pipeline/present/verdict.py): case ids from the user's data are escaped before a terminal or
MLflow shows them (issue 24, item 7)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from test_page import blank, decided, variant

from pipeline.artifacts.audit import Audit, Share
from pipeline.artifacts.benchmark import Benchmark, Interval, Speed, Spread, TimeToQuality
from pipeline.artifacts.comparison import Decisions, Flip, Stats

FORGED = "ordinary/x\npublish: float16 ACCEPT; review: http://evil\x1b[2J"
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "<script>alert(1)</script><img src=x onerror=alert(2)>[click](javascript:alert(3))"


def _verdict(ids: list[str]):
    from pipeline.present import verdict

    flips = tuple(blank(Flip, id=i, kind="ordinary", boundary=False, near_boundary=False, reference_class=1, trial_class=2,
                        reference_margin=0.5, trial_margin=0.1) for i in ids)
    decision = decided("rollback", reasons=[f"1 flip among real samples: {ids[0]}"], env={})
    return verdict.verdict("float16", decision, blank(Stats, flips=blank(Decisions, flip_list=flips)))


def test_an_id_cannot_forge_a_line_or_reach_the_terminal_raw():
    from pipeline.present import verdict

    out = verdict.text(_verdict([FORGED, "y" * 3000]))
    assert "\x1b" not in out and "\npublish:" not in out
    assert "ordinary/x\\npublish: float16 ACCEPT; review: http://evil\\x1b[2J" in out
    assert max(len(line) for line in out.splitlines()) < 400 and "…(+2880 chars)" in out  # a 3,000-character id is capped


def test_html_and_markdown_links_in_an_id_do_not_reach_the_mlflow_description_raw():
    from pipeline.present import verdict

    md = verdict.markdown([_verdict([SCRIPT])]) + verdict.headline([_verdict([SCRIPT])])
    assert "<script" not in md and "<img" not in md and not re.search(r"(?<!\\)\]\(javascript:", md)  # no link
    assert "&lt;script>" in md and "\\[click\\](javascript:alert(3))" in md
    assert "<script" not in verdict.html([_verdict([SCRIPT])])  # report.html escapes, as before


def _speed(verdict_: str, median: float, low: float, high: float, aa: tuple[float, float] = (0.93, 1.08)) -> Benchmark:
    interval = Interval(median=median, low=low, high=high, level=0.95, coverage=0.96, n=9)
    return blank(Benchmark, variant="bfloat16", speedup=blank(Spread, median=median, q1=low, q3=high),
                 speed=Speed(verdict_, interval, replace(interval, median=1.0, low=aa[0], high=aa[1]), "m"))


def test_the_speed_words_follow_the_interval_never_a_bare_ratio():
    """Issue 48, item 6: x1.25 from a variant that ran nothing in bfloat16 was a ratio of noise."""
    from pipeline.present import page, verdict

    accept = decided("accept", variant="bfloat16")
    noise = _speed("no measurable difference", 1.25, 0.91, 1.40, (0.85, 1.30))
    said = verdict.verdict("bfloat16", accept, benchmark=noise).sentence
    assert ("the rule passed, no measurable difference (x1.25, 95 % interval 0.91-1.40; FP32 against itself 0.85-1.30) "
            "on the benchmark's CPU: AMP gains nothing there but memory") in said
    assert "faster" not in said and "slower" not in said
    row = dict(page.rows([variant("bfloat16", accept, benchmark=noise)]))
    assert [v for k, v in row.items() if k.startswith("benchmark: speed")] == [
        ["no measurable difference (x1.25, 95 % interval 0.91-1.40; FP32 against itself 0.85-1.30)"]
    ]
    # The A/A flagged audit quotes the verdict, not the ratio.
    barely = blank(Audit, flagged=True, total=blank(Share, reduced_share=0.0), line="AMP did not engage")
    flagged = verdict.verdict("bfloat16", accept, benchmark=noise, audit=barely).sentence
    assert "the benchmark measured no measurable difference (x1.25, 95 % interval" in flagged
    # Too few rounds for any interval: said so, with the fix.
    unbounded = _speed("no measurable difference", 0.83, float("-inf"), float("inf"))
    assert verdict.speed_words(unbounded) == (
        "no measurable difference (x0.83, 9 rounds are too few for a 95 % interval; raise bench.repeats)"
    )
    # A record written before the A/A arm existed: its median is quoted as not judged, with the command that judges it.
    old = blank(Benchmark, variant="bfloat16", speedup=blank(Spread, median=1.25, q1=1.1, q3=1.3))
    assert verdict.speed_words(old) == (
        "speed not judged (x1.25; no interval recorded: rerun `dvc repro -f benchmark@bfloat16`)"
    )
    assert verdict.speed_words(blank(Benchmark)) is None


def test_a_faster_step_that_needs_more_updates_is_not_called_a_switch_to_amp():
    """Issue 48, item 3: a step 2x faster that needs 2.5x the updates is slower to FP32's final loss."""
    from pipeline.present import page, verdict

    accept = decided("accept", variant="bfloat16")

    def bench(amp, ratio=None, low=None, high=None, verdict_="slower", replicates=(140, 150)):
        b = _speed("faster", 2.0, 1.9, 2.1)
        quality = TimeToQuality(verdict=verdict_, target=1.7, amp=amp, of=375, fp32=150, fp32_replicates=tuple(replicates),
                                ratio=ratio, low=low, high=high, method="m")
        return replace(b, speed=replace(b.speed, to_quality=quality))

    slower = bench(375, 1.25, 1.19, 1.41)
    said = verdict.verdict("bfloat16", accept, benchmark=slower).sentence
    assert ("x2.00 faster (95 % interval 1.90-2.10; FP32 against itself 0.93-1.08); time to FP32's final loss: x1.25 "
            "(1.19-1.41; AMP needed 375 of 375 updates, FP32 150; FP32's replicates 140-150) on the benchmark's CPU: "
            "faster per step, not to FP32's final loss: keep FP32 there") in said and "switch to AMP" not in said
    row = dict(page.rows([variant("bfloat16", accept, benchmark=slower)]))
    assert [v for k, v in row.items() if k.startswith("benchmark: speed")] == [[verdict.speed_words(slower)]]
    assert "switch to AMP there" in verdict.verdict("bfloat16", accept, benchmark=bench(100, 0.35, 0.3, 0.4, "faster")).sentence
    never = bench(None, verdict_="never reached")
    assert verdict.speed_words(never).endswith(
        "; never reached FP32's final loss in 375 updates (FP32 150; FP32's replicates 140-150): no time-to-quality claim")
    assert "keep FP32 there" in verdict.verdict("bfloat16", accept, benchmark=never).sentence
    # FP32 trained again did not get there either: AMP not getting there is within FP32's own spread.
    mixed = verdict.verdict("bfloat16", accept, benchmark=bench(None, verdict_="never reached", replicates=(None, 150)))
    assert "FP32's replicates never, 150): no time-to-quality claim" in mixed.sentence
    assert "no measurable gain to FP32's final loss" in mixed.sentence and "keep FP32" not in mixed.sentence


def test_the_training_line_says_no_gradscaler_for_bfloat16_and_not_judged_when_nothing_trained():
    """A bfloat16 run that trained says why its scale stayed 1; an inference-only one (no step compared) says that
    training was not judged, whatever its dtype (02d2f5e)."""
    from pipeline.artifacts.comparison import Training
    from pipeline.present import verdict

    bf16 = decided("accept", variant="bfloat16", policy={"dtype": "bfloat16"})
    trained = blank(Stats, training=blank(Training, steps=20, max_loss_gap=0.01))
    line = verdict.verdict("bfloat16", bf16, trained).training
    assert line.startswith("training: worst loss gap 0.01, stayed inside its band; no GradScaler (bfloat16 keeps"), line
    untrained = verdict.verdict("bfloat16", replace(bf16, training="not judged"), blank(Stats))
    assert untrained.training == "training: not judged (reference.train_steps 0: an inference-only verdict)"
    assert untrained.sentence.endswith("(inference only: training not judged)")


def test_the_gain_names_the_benchmarks_own_machine_never_this_cpu(monkeypatch):
    """Issue 51, friction 5: the default run skipped the benchmark and read the figures committed from another machine,
    yet said "on this CPU". The gain names the machine of the benchmark's record (its env), and its advice says "there"."""
    from pipeline.artifacts import benchmark
    from pipeline.present import verdict

    monkeypatch.chdir(ROOT)
    committed = benchmark.read("float16")  # data/benchmark/float16/benchmark.json as the default run reads it
    assert committed.benchmarked and committed.env["device_name"], committed
    accept = decided("accept", env={"backend": "cpu", "device_name": "this machine's CPU", "capability": "AVX2"})
    said = verdict.verdict("float16", accept, benchmark=committed)
    shown = [said.sentence, verdict.text(said), verdict.html([said]), verdict.markdown([said]), verdict.one_line([said])]
    where = f"on {committed.env['device_name']} (CPU, {committed.env['capability']})"
    assert all(where in s and "this CPU" not in s and "this machine" not in s for s in shown), said.sentence
    assert " here" not in said.gain and " there" in said.gain, said.gain
    gpu = replace(committed, env={"backend": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "capability": "9.0"})
    assert "on NVIDIA H100 80GB HBM3 (GPU, capability 9.0)" in verdict.verdict("float16", accept, benchmark=gpu).gain
    unnamed = replace(committed, env={"backend": "rocm"})
    assert f"{verdict.speed_words(committed)} on the benchmark's GPU" in verdict.verdict("float16", accept,
                                                                                         benchmark=unnamed).gain
