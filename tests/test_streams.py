"""compare_streams by chunks: the same statistics whatever the chunking, one chunk read at a time, a bounded table."""

import math

import pytest
import torch

from pipeline.artifacts import outputs

from pipeline.artifacts import comparison

from pipeline.compare import streams
from pipeline import task
from pipeline.config import AcceptanceConfig, CompareConfig, TaskConfig
from _steps import step

STEPS = tuple(step(i, 1.0 / (i + 1), scale=2.0**16) for i in range(4))
RUNS = streams.Trajectories(STEPS, STEPS, 2.0**16)


def _sources(ids, y, has, ref, trial, token_mask=None):
    """In-memory sources; the AMP-trained model's outputs are the trial's."""
    return streams.Sources(ids, y, has, streams.InMemory(ref), streams.InMemory(trial), streams.InMemory(trial),
                           token_mask=token_mask)


def _set(n=600, c=10, seed=0, per_token=False):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 6, c) if per_token else (n, c)
    ref = torch.randn(shape, generator=g) * 2
    trial = ref.to(torch.bfloat16).float()
    ids = [f"ordinary/{i}" for i in range(n - 30)] + [f"edge/{i}" for i in range(20)] + [f"boundary/{i}" for i in range(10)]
    targets = ref.argmax(-1)
    if per_token:
        targets[:, -1] = -100
    has_target = torch.tensor([i.startswith("ordinary/") for i in ids])
    return ids, targets, has_target, {"logits": ref}, {"logits": trial}


class Counting:
    """A source around another that remembers the most rows it was asked for at once, and how many reads it served."""

    def __init__(self, source):
        self.source, self.names, self.rows, self.shape, self.most = source, source.names, source.rows, source.shape, 0
        self.calls = 0

    def read(self, name, start, stop):
        self.most = max(self.most, stop - start)
        self.calls += 1
        return self.source.read(name, start, stop)


@pytest.mark.parametrize("per_token", [False, True])
def test_statistics_do_not_depend_on_the_chunking(per_token):
    ids, y, has, ref, trial = _set(per_token=per_token)
    rule = AcceptanceConfig(boundary_margin=0.05, boundary_margin_kind="probability")
    out = {}
    for chunk in (10**9, 700, 61):
        stats, table = streams.compare_streams("classification", rule, _sources(ids, y, has, ref, trial), RUNS,
                                               cfg=CompareConfig(chunk_elements=chunk, table_rows=7))
        out[chunk] = (stats, table)
    (a, ta), (b, tb), (c, tc) = out.values()
    for s in (b, c):
        exact = ("failing", "max_abs", "p99_abs", "max_rel", "p99_rel", "min_passing_atol", "min_passing_rtol")
        sv, av = s.values["logits"], a.values["logits"]
        assert [getattr(sv, k) for k in exact] == [getattr(av, k) for k in exact]
        assert sv.mean_abs == pytest.approx(av.mean_abs, rel=1e-6)  # float32 sums per slice
        assert s.flips == a.flips
        assert s.quality == a.quality if not per_token else s.quality.trial == a.quality.trial
        if per_token:
            assert s.distribution.kl_p99 == a.distribution.kl_p99
            assert s.distribution.kl_mean == pytest.approx(a.distribution.kl_mean, rel=1e-9)
    assert ta == tb == tc


@pytest.mark.parametrize("per_token", [False, True])
def test_a_source_compared_with_itself_is_read_once_a_chunk(per_token):
    """Diagnose compares the reference with itself: one reader for the three sides is read (and decoded) once a chunk,
    with the statistics of three readers of the same outputs."""
    ids, y, has, ref, _ = _set(per_token=per_token)
    cfg = CompareConfig(chunk_elements=700)
    one = Counting(streams.InMemory(ref))
    alone, _ = streams.compare_streams("classification", AcceptanceConfig(), streams.Sources(ids, y, has, one, one, one), RUNS,
                                       cfg=cfg)
    three = [Counting(streams.InMemory(ref)) for _ in range(3)]
    apart, _ = streams.compare_streams("classification", AcceptanceConfig(), streams.Sources(ids, y, has, *three), RUNS, cfg=cfg)
    assert alone == apart and alone.flips.real_flips == 0 and alone.values["logits"].max_abs == 0.0
    chunks = math.ceil(len(ids) / alone.outputs.chunk_rows)
    assert one.calls == chunks and [c.calls for c in three] == [chunks] * 3


def test_table_keeps_every_flip_and_the_worst_others():
    ids, y, has, ref, trial = _set()
    stats, table = streams.compare_streams("classification", AcceptanceConfig(), _sources(ids, y, has, ref, trial), RUNS,
                                           cfg=CompareConfig(table_rows=5))
    flipped = {f.id for f in stats.flips.flip_list}
    assert flipped and flipped <= {r["id"] for r in table}
    assert len(table) == len(flipped) + 5
    others = sorted((r for r in table if not r["flipped"]), key=lambda r: -r["max_abs_gap"])
    gaps = (trial["logits"] - ref["logits"]).abs().amax(1)
    not_flipped = [i for i, x in enumerate(ids) if x not in flipped]
    fifth = sorted((float(gaps[i]) for i in not_flipped), reverse=True)[4]
    assert others[-1]["max_abs_gap"] == pytest.approx(fifth)
    assert [r["id"] for r in table] == [i for i in ids if i in {r["id"] for r in table}]  # case order
    counts = stats.flips
    assert counts.flips + counts.near_boundary_flips + counts.boundary_flips == len(flipped)  # exact counts


def test_a_fixed_set_100_times_the_default_is_read_one_chunk_at_a_time(tmp_path):
    """The default fixed set is ~270 cases; 100 times that, streamed from real files, never holds more than a chunk."""
    ids, y, has, ref, trial = _set(n=27_000, c=10, seed=5)
    paths = {}
    for name, data in (("ref", ref), ("trial", trial)):
        chunks = ({"logits": data["logits"][s : s + 4000]} for s in range(0, 27_000, 4000))
        paths[name] = outputs.write_outputs(tmp_path / f"{name}.safetensors", chunks, ids)
    chunk = 20_000  # elements: 2,000 cases of 10 scores
    ref_src = Counting(outputs.OutputsReader(tmp_path / "ref.safetensors", paths["ref"]))
    trial_src = outputs.OutputsReader(tmp_path / "trial.safetensors", paths["trial"])
    sources = streams.Sources(ids, y, has, ref_src, trial_src, trial_src)
    stats, table = streams.compare_streams("classification", AcceptanceConfig(), sources, RUNS,
                                           cfg=CompareConfig(chunk_elements=chunk, table_rows=20))
    assert ref_src.most == chunk // 10
    assert stats.values["logits"].elements == 270_000 and stats.outputs.chunk_rows == 2000
    whole = streams.compare_streams("classification", AcceptanceConfig(), _sources(ids, y, has, ref, trial), RUNS)[0]
    assert stats.flips == whole.flips and stats.values["logits"].p99_abs == whole.values["logits"].p99_abs


def test_regression_and_typed_stats(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(7)
    ids = [f"ordinary/{i}" for i in range(50)] + ["edge/zeros"]
    ref = {"output": torch.randn(51, 1, generator=g)}
    trial = {"output": ref["output"] + 0.01}
    y = ref["output"].clone()
    has = torch.tensor([True] * 50 + [False])
    rule = AcceptanceConfig(threshold=0.0)
    runs = streams.Trajectories(STEPS, STEPS, 1.0, replicate=STEPS)
    stats, table = streams.compare_streams("regression", rule, _sources(ids, y, has, ref, trial), runs,
                                           metric=streams.Metric("neg_mae"))
    assert stats.quality.trial == pytest.approx(-0.01, rel=1e-5) and stats.quality.metric == "neg_mae"
    crossing = ((ref["output"] < 0) & (ref["output"] + 0.01 >= 0)).sum()
    assert stats.flips.flips == int(crossing)
    assert stats.training.noise.max_replicate_gap == 0.0
    monkeypatch.chdir(tmp_path)
    comparison.write("float16", stats, table)
    s = comparison.read("float16")
    assert s == stats and s.flips.real_flips == int(crossing) and s.distribution is None
    assert s.max_abs_gap == pytest.approx(0.01, rel=1e-4) and comparison.read_table("float16") == table
    assert not math.isnan(s.training.max_loss_gap)


def test_a_regression_threshold_is_judged_on_every_column_through_the_chunks():
    """[N, 4] regression outputs, several chunks: a value of column 3 crossing the threshold is a flip of its case,
    named, as a crossing in column 0 is; outputs that stay on their side flip nothing."""
    g = torch.Generator().manual_seed(3)
    ids = [f"ordinary/{i}" for i in range(40)]
    ref = {"output": torch.randn(40, 4, generator=g) + 3.0}  # every value above the threshold 0
    trial = {"output": ref["output"].clone()}
    trial["output"][7, 3] = -0.5
    trial["output"][21, 0] = -0.5
    runs = streams.Trajectories(STEPS, STEPS, 1.0, replicate=STEPS)
    rule = AcceptanceConfig(threshold=0.0, min_quality=None, max_quality_drop=None)
    stats, _ = streams.compare_streams("regression", rule, _sources(ids, ref["output"], torch.ones(40, dtype=torch.bool),
                                                                    ref, trial), runs, cfg=CompareConfig(chunk_elements=32))
    assert stats.flips.flips == 2 and {f.id for f in stats.flips.flip_list} == {"ordinary/7", "ordinary/21"}
    stats, _ = streams.compare_streams("regression", rule, _sources(ids, ref["output"], torch.ones(40, dtype=torch.bool),
                                                                    ref, ref), runs, cfg=CompareConfig(chunk_elements=32))
    assert stats.flips.flips == 0


def test_user_metric_sees_the_target_rows_once_and_sets_the_direction():
    ids, y, has, ref, trial = _set(n=200)
    calls = []

    def error_rate(out, target):
        calls.append(out.shape[0])
        return float((out.argmax(-1) != target).double().mean())

    metric = streams.Metric("mypkg.metrics:error_rate", higher_is_better=False, function=error_rate)
    stats, _ = streams.compare_streams("classification", AcceptanceConfig(), _sources(ids, y, has, ref, trial), RUNS,
                                       metric=metric, cfg=CompareConfig(chunk_elements=300))
    assert calls == [170, 170, 170]  # reference, trial, trained: every ordinary case at once, whatever the chunking
    assert stats.quality.reference == 0.0 and stats.quality.higher_is_better is False


def test_attention_mask_excludes_padding_positions():
    ids, y, has, ref, trial = _set(n=60, per_token=True)
    trial["logits"] = trial["logits"].clone()
    trial["logits"][:, 2, :] += torch.randn(60, 10) * 5  # position 2: noise that flips tokens
    mask = torch.ones(60, 6, dtype=torch.long)
    mask[:, 2] = 0  # ... but it is padding
    masked = _sources(ids, y, has, ref, trial, token_mask=mask)
    with_mask, _ = streams.compare_streams("classification", AcceptanceConfig(), masked, RUNS)
    without, _ = streams.compare_streams("classification", AcceptanceConfig(), _sources(ids, y, has, ref, trial), RUNS)
    # the distribution's tokens are the ordinary cases' (the first 30): their position 2 is gone
    assert with_mask.distribution.tokens == without.distribution.tokens - 30 + int((y[:30, 2] == -100).sum())
    assert with_mask.flips.real_flips < without.flips.real_flips
    assert all(f.position != 2 for f in with_mask.flips.flip_list)
    assert task.token_mask_of({"input_ids": torch.zeros(2, 3), "attention_mask": mask[:2, :3]}) is not None


def test_padding_is_not_judged_on_values_or_finiteness_either():
    """A padding position (token mask 0) is no output the application uses: whatever the trial or the AMP-trained model
    computes there (an fp16 overflow at a fully masked row, garbage) is judged by no criterion, values and finiteness
    included, as the decisions and KL already ignore it. Without a token mask the positions whose target is -100 are all
    that is known of padding. The same change at a kept position still fails, and names its case."""
    from pipeline import rule as acceptance

    ids, y, has, ref, _ = _set(n=40, per_token=True)  # position 5 ignored everywhere (target -100)
    ref = {"logits": ref["logits"], "tags": ref["logits"][..., :4].clone()}  # a second per-token head
    mask = torch.ones(40, 6, dtype=torch.long)
    mask[:, 3] = 0  # padding
    mask[:, 5] = 0  # padding too: its target is -100 already
    strict = AcceptanceConfig(outputs={"*": comparison_tolerance()}, min_quality=None, loss_noise_multiple=None)
    garbage = {k: v.clone() for k, v in ref.items()}
    garbage["logits"][:, 5] = math.inf
    garbage["logits"][:, 3] += 50.0
    garbage["tags"][:, 3] = math.nan
    stats, _ = streams.compare_streams("classification", strict, _sources(ids, y, has, ref, garbage, token_mask=mask), RUNS)
    assert stats.values["logits"].elements == 40 * 4 * 10 and stats.values["tags"].elements == 40 * 4 * 4
    assert stats.values["logits"].failing == 0 and stats.nonfinite.trial.rows == stats.nonfinite.trained.rows == 0
    assert sorted(stats.heads) == ["tags"] and stats.heads["tags"].cases == 40 * 4  # decided by default, padding left out
    assert acceptance.decide(stats, strict).decision == "accept"
    unmasked = {"logits": garbage["logits"]}  # no mask: the -100 targets (position 5) are the padding known
    stats, _ = streams.compare_streams("classification", strict, _sources(ids, y, has, {"logits": ref["logits"]}, unmasked), RUNS)
    assert stats.values["logits"].elements == 40 * 5 * 10 and stats.values["logits"].nonfinite_trial_only == 0
    kept = {k: v.clone() for k, v in garbage.items()}
    kept["logits"][7, 1, 0] += 1.0  # one element at a kept position
    kept["tags"][9, 0, 0] = math.inf
    stats, _ = streams.compare_streams("classification", strict, _sources(ids, y, has, ref, kept, token_mask=mask), RUNS)
    assert stats.values["logits"].failing == 1 and stats.values["logits"].failing_ids == ("ordinary/7",)
    assert stats.nonfinite.trial.ids == ("ordinary/9",) and stats.nonfinite.trained.ids == ("ordinary/9",)
    assert acceptance.decide(stats, strict).decision == "rollback"


def test_a_real_position_without_a_target_is_still_judged_on_values_and_finiteness():
    """A sequence's last real position has no next token (target -100), yet generation reads its scores next: where the
    token mask says it is real, an fp16 overflow there is a non-finite output (a linear recurrence's activations grow
    along the sequence and overflow there first). Its decisions stay out of the flips and KL (no target)."""
    from pipeline import rule as acceptance

    ids, y, has, ref, trial = _set(n=40, per_token=True)  # position 5: target -100 in every case
    mask = torch.ones(40, 6, dtype=torch.long)  # ... but real
    rule = AcceptanceConfig(min_quality=None, loss_noise_multiple=None)
    healthy, _ = streams.compare_streams("classification", rule, _sources(ids, y, has, ref, trial, token_mask=mask), RUNS)
    assert healthy.values["logits"].elements == 40 * 6 * 10 and healthy.distribution.tokens == 10 * 5  # 10 ordinary cases
    overflow = {"logits": trial["logits"].clone()}
    overflow["logits"][:4, 5, 2] = math.inf
    stats, _ = streams.compare_streams("classification", rule, _sources(ids, y, has, ref, overflow, token_mask=mask), RUNS)
    assert stats.values["logits"].nonfinite_trial_only == 4 and stats.nonfinite.trained.rows == 4
    assert stats.distribution.tokens == 10 * 5 and stats.flips.real_flips == healthy.flips.real_flips
    decided = acceptance.decide(stats, rule)
    assert decided.decision == "rollback" and any("4 non-finite element(s)" in r for r in decided.reasons), decided.reasons


def comparison_tolerance():
    from pipeline.config import Tolerance

    return Tolerance(atol=1e-3, rtol=0.0)


def test_sources_refuse_outputs_of_another_set_and_metric_follows_the_task():
    ids, y, has, ref, trial = _set(n=20)
    with pytest.raises(ValueError, match="outputs hold 20/19/20 rows"):
        short = streams.InMemory({"logits": trial["logits"][:19]})
        streams.Sources(ids, y, has, streams.InMemory(ref), short, streams.InMemory(trial))
    auto = streams.Metric.for_task(TaskConfig(kind="regression"))
    assert (auto.name, auto.higher_is_better, auto.function) == ("neg_rmse", True, None)
    user = streams.Metric.for_task(TaskConfig(metric="math:fsum", metric_direction="lower"))
    assert user.function is math.fsum and not user.higher_is_better


@pytest.mark.parametrize("per_token", [False, True])
def test_an_fp64_rerun_of_the_first_cases_judges_those_cases_alone(per_token):
    """reference.fp64_arbiter: N covers the fixed set's first N cases: the FP64 check over them is the check of those
    cases alone, at any chunking, and says how many it covered; a full re-run says nothing more."""
    ids, y, has, ref, trial = _set(n=90, per_token=per_token)
    fp64 = {"logits": ref["logits"].double() + 1e-9}
    rule = AcceptanceConfig()

    def arbiter(n_ids, n_fp64, chunk):
        sources = streams.Sources(ids[:n_ids], y[:n_ids], has[:n_ids], streams.InMemory({"logits": ref["logits"][:n_ids]}),
                                  streams.InMemory({"logits": trial["logits"][:n_ids]}),
                                  streams.InMemory({"logits": trial["logits"][:n_ids]}),
                                  streams.InMemory({"logits": fp64["logits"][:n_fp64]}))
        stats, _ = streams.compare_streams("classification", rule, sources, RUNS, cfg=CompareConfig(chunk_elements=chunk))
        return stats.arbiter["logits"]

    alone = arbiter(37, 37, 10**9)  # the first 37 cases, the FP64 re-run covering all of them
    assert alone.cases is None and "cases" not in alone.as_dict()
    for chunk in (10**9, 250, 61):  # chunks that end before, at and after the 37th case
        partial = arbiter(90, 37, chunk)
        assert partial.cases == 37
        assert math.isclose(partial.amp_rmse_vs_fp64, alone.amp_rmse_vs_fp64, rel_tol=1e-12), chunk
        assert math.isclose(partial.fp32_rmse_vs_fp64, alone.fp32_rmse_vs_fp64, rel_tol=1e-12), chunk


def _close(a, b, key=""):
    """Equal numbers within float32 rounding (the tolerances a reviewer reads are rounded up to 4 digits: 1e-3);
    counts, flags and names exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), key
        for k in a:
            _close(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{key}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        rel = 1e-3 if "min_passing" in key else 1e-4
        assert (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=rel, abs_tol=1e-7), (key, a, b)
    else:
        assert a == b, (key, a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("per_token", [False, True])
def test_compare_on_the_gpu_gives_the_cpu_statistics(tmp_path, per_token):
    """Each chunk copied to the device and computed there: the statistics and the table of the CPU, within
    float32 rounding, from files (mapped chunks) with an FP64 arbiter, a second head and non-finite trial rows."""
    ids, y, has, ref, trial = _set(n=900, c=40, per_token=per_token)
    trial["logits"] = trial["logits"].clone()
    trial["logits"][3] = math.nan
    aux = torch.randn(900, 5)
    ref["aux"], trial["aux"] = aux, aux.half().float()  # allowed: a tensor, not a model
    files = {}
    for side, tensors in (("reference", ref), ("trial", trial)):
        files[side] = tmp_path / f"{side}.safetensors"
        outputs.write_outputs(files[side], iter([tensors]), ids)
    fp64 = streams.InMemory({name: t.double() for name, t in ref.items()})
    rule = AcceptanceConfig(boundary_margin=0.05, boundary_margin_kind="probability")
    cfg = CompareConfig(chunk_elements=20_000, table_rows=7)
    results = []
    for device in ("cpu", "cuda"):
        sources = streams.Sources(ids, y, has, outputs.OutputsReader(files["reference"]), outputs.OutputsReader(files["trial"]),
                                  streams.InMemory(trial), fp64=fp64)
        results.append(streams.compare_streams("classification", rule, sources, RUNS, cfg=cfg, device=device))
    (cpu, cpu_table), (gpu, gpu_table) = results
    assert cpu.flips.real_flips > 0 and cpu.nonfinite.trial.rows == 1
    _close(cpu.as_dict(), gpu.as_dict())
    _close(cpu_table, gpu_table)


def test_a_regression_without_any_target_is_compared_and_judged_without_quality():
    """A fixed set whose cases carry no target (a rule with max_quality_drop and min_quality null judges it on values,
    decisions and training alone): compare gives no quality, and the rule judges the rest."""
    from pipeline import rule as acceptance

    n = 30
    ids = [f"ordinary/{i}" for i in range(n)]
    ref = {"output": torch.randn(n, 4, generator=torch.Generator().manual_seed(0))}
    no_target = torch.zeros(n, dtype=torch.bool)
    rule = AcceptanceConfig(outputs={"*": comparison_tolerance()}, max_quality_drop=None, min_quality=None,
                            loss_noise_multiple=None)
    stats, _ = streams.compare_streams("regression", rule, _sources(ids, torch.zeros(n, 4), no_target, ref, ref), RUNS)
    assert math.isnan(stats.regression["reference"].mae) and math.isnan(stats.quality.reference)
    assert acceptance.decide(stats, rule).decision == "accept"
    off = {"output": ref["output"] + 0.01}
    stats, _ = streams.compare_streams("regression", rule, _sources(ids, torch.zeros(n, 4), no_target, ref, off), RUNS)
    assert acceptance.decide(stats, rule).decision == "rollback"


def test_a_per_token_single_logit_head_is_decided_by_its_sign_at_the_kept_positions():
    """A per-token head [N, T, 1] (a sigmoid per token: a tagger's yes/no) is decided per token by the sign of its
    logit, padding left out: a crossing within the value tolerance is a changed decision, named case@position; the
    same crossing at a padded position is not."""
    from pipeline import rule as acceptance

    ids, y, has, ref, _ = _set(n=40, per_token=True)
    flag = torch.full((40, 6, 1), 0.5)
    flag[::2] = -0.5  # logits of both signs (a head whose every value lies in [0, 1] is read as a probability)
    flag[3, 1, 0] = flag[4, 3, 0] = 0.01  # near 0 (position 3 is padding)
    mask = torch.ones(40, 6, dtype=torch.long)
    mask[:, 3] = 0
    reference = {"logits": ref["logits"], "flag": flag}
    crossed = {"logits": ref["logits"].clone(), "flag": flag.clone()}
    crossed["flag"][3, 1, 0] = crossed["flag"][4, 3, 0] = -0.01
    rule = AcceptanceConfig(min_quality=None, loss_noise_multiple=None)
    stats, _ = streams.compare_streams("classification", rule, _sources(ids, y, has, reference, crossed, token_mask=mask), RUNS)
    head = stats.heads["flag"]
    assert head.unit == "token" and head.cases == 40 * 5 and head.real_flips == 1
    assert [f.label for f in head.flip_list] == ["ordinary/3@1"] and head.flip_list[0].near_boundary
    decision = acceptance.decide(stats, rule)
    assert decision.decision == "rollback" and any(r.startswith("decisions 'flag'") for r in decision.reasons)


def test_a_per_token_regression_is_judged_on_its_kept_positions_only():
    """A per-token regression [N, T, 1] whose last two positions are padding: NaN or garbage there is no output
    anyone uses, for its quality (RMSE against the targets) as for its values; a change at a kept position counts."""
    from pipeline import rule as acceptance
    from pipeline.config import Tolerance

    g = torch.Generator().manual_seed(0)
    n, t = 30, 5
    ref = torch.randn(n, t, 1, generator=g)
    y = ref + 0.01 * torch.randn(n, t, 1, generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    mask[:, -2:] = 0
    ids, has = [f"ordinary/{i}" for i in range(n)], torch.ones(n, dtype=torch.bool)
    rule = AcceptanceConfig(outputs={"*": Tolerance(atol=0.01, rtol=0.01)}, loss_noise_multiple=None)
    verdicts = []
    for padded in (math.nan, 1e3):
        trial = ref.clone()
        trial[:, -2:] = padded
        stats, _ = streams.compare_streams("regression", rule, _sources(ids, y, has, {"output": ref}, {"output": trial},
                                                                        token_mask=mask), RUNS)
        assert stats.quality.trial == stats.quality.reference and math.isfinite(stats.quality.trial)
        verdicts.append(acceptance.decide(stats, rule).decision)
    assert verdicts == ["accept", "accept"]
    trial = ref.clone()
    trial[:, 0] += 1.0
    stats, _ = streams.compare_streams("regression", rule, _sources(ids, y, has, {"output": ref}, {"output": trial},
                                                                    token_mask=mask), RUNS)
    assert stats.quality.trial < stats.quality.reference and acceptance.decide(stats, rule).decision == "rollback"
