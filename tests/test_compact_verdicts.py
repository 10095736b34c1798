"""A verdict never depends on the store: on crafted near-ties (a target within half a quantum of its neighbour in rank,
exact ties at a rank, a label's value within a quantum of its threshold), every quality figure the rule reads and every
decision are the same under ``compare.store: compact`` as under ``full`` (real safetensors files, compare's streams)."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from pipeline import rule as acceptance
from pipeline.artifacts import compact, outputs
from pipeline.compare import streams
from pipeline.config import AcceptanceConfig, CompareConfig, TaskConfig, Tolerance
from pipeline.errors import UserError
from _steps import step

STEPS = tuple(step(i, 1.0 / (i + 1), scale=2.0**16) for i in range(4))
RUNS = streams.Trajectories(STEPS, STEPS, 2.0**16)
V, TARGET, NEIGHBOUR = 1000, 700, 100
LOOSE = {"*": Tolerance(atol=100.0, rtol=0.0)}
"""Value gaps far from their tolerance: the criteria under test are quality and decisions."""


def _judge(tmp_path, ref, trial, targets, store, rule, task):
    n = ref.shape[0]
    ids = [f"ordinary/{i}" for i in range(n)]
    readers = {}
    for side, x in (("reference", ref), ("trial", trial)):
        path = tmp_path / f"{side}-{store}.safetensors"
        outputs.write_outputs(path, [{"logits": x[: n // 2]}, {"logits": x[n // 2 :]}], ids, store=store, task=task)
        readers[side] = outputs.OutputsReader(path)
    sources = streams.Sources(ids, targets, torch.ones(n, dtype=torch.bool), readers["reference"], readers["trial"],
                              readers["trial"])
    stats, _ = streams.compare_streams(task.kind, rule, sources, RUNS, metric=streams.Metric.for_task(task),
                                       cfg=CompareConfig(chunk_elements=40_000))
    return stats, acceptance.decide(stats, rule), readers["trial"].store


def _same_verdict(full, small, store="compact"):
    (f, fd, f_store), (s, sd, s_store) = full, small
    assert (f_store, s_store) == ("full", store)
    fq, sq = f.quality, s.quality
    assert (sq.metric, sq.reference, sq.trial, sq.trained) == (fq.metric, fq.reference, fq.trial, fq.trained)
    assert sq.counts == fq.counts and sq.paired == fq.paired
    assert s.flips.real_flips == f.flips.real_flips and s.flips.flips == f.flips.flips
    if f.distribution is not None:
        assert s.distribution.top1_agreement == f.distribution.top1_agreement
    assert (sd.decision, sd.inference, sd.training) == (fd.decision, fd.inference, fd.training), (fd.reasons, sd.reasons)


def _near_ties(k, tokens=64, seed=0):
    """[2, tokens, V] scores whose target (class 700) is the k-th best on every token. The reference's next class is far
    below it; on the trial's even tokens class 100 (a lower index) lies 1 ulp to 1e-4 below the target, within half a
    quantum (about 4.6e-4 here), and on the odd tokens class 100 is exactly the target's score, at a higher rank (tie
    by index: a miss on both stores) on tokens 1 mod 4, while class 900 ties it from behind on tokens 3 mod 4."""
    g = torch.Generator().manual_seed(seed)
    ref = -30.0 * torch.rand(2, tokens, V, generator=g)
    ref[..., 0] = 30.0  # the row's span: a quantum of 60 / 65531; class 0 and 901.. are ahead of the target
    for j in range(1, k - 1):
        ref[..., 900 + j] = 30.0 - j
    ref[..., TARGET] = 5.0 if k > 1 else 40.0
    trial = ref.clone()
    below = torch.tensor([0.0, 1e-6, 1e-5, 1e-4]).repeat(tokens // 8)
    trial[:, 0::2, NEIGHBOUR] = torch.nextafter(ref[:, 0::2, TARGET] - below, torch.tensor(-math.inf))
    trial[:, 1::4, NEIGHBOUR] = ref[:, 1::4, TARGET]
    trial[:, 3::4, 950] = ref[:, 3::4, TARGET]
    return ref, trial, torch.full((2, tokens), TARGET)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_top_k_near_ties_give_the_same_quality_and_verdict_under_both_stores(tmp_path, k):
    ref, trial, targets = _near_ties(k)
    task = TaskConfig(metric="top_k", top_k=k)
    rule = AcceptanceConfig(outputs=LOOSE, max_quality_drop=0.3, min_quality=0.5, max_kl_mean=1.0,
                            min_top1_agreement=0.9, loss_noise_multiple=None)
    full = _judge(tmp_path, ref, trial, targets, "full", rule, task)
    small = _judge(tmp_path, ref, trial, targets, "compact", rule, task)
    _same_verdict(full, small)
    if k > 1:  # the ties at the k-th rank did cost the tokens 1 mod 4, and nothing else
        assert full[0].quality.counts["trial"] == (96, 128) and full[1].decision == "accept"


def test_the_reported_case_top_k_reads_the_same_quality_under_compact():
    """Issue 50.2: 128 tokens, every target the second best, the trial's neighbour within half a quantum below it and of
    a lower index on 64 of them: quality 1.0 under ``full`` and 0.77 under ``compact`` before the store kept the k best
    (the codes tied 30 of the 64 near ties, and the tie went to the lower index), so ``max_quality_drop`` rolled back
    under compact only."""
    import tempfile
    from pathlib import Path

    ref, trial, targets = _near_ties(2)
    trial[:, 1::2] = ref[:, 1::2]  # only the near ties (64 tokens)
    task = TaskConfig(metric="top_k", top_k=2)
    rule = AcceptanceConfig(outputs=LOOSE, max_quality_drop=0.01, loss_noise_multiple=None)
    with tempfile.TemporaryDirectory() as folder:
        full = _judge(Path(folder), ref, trial, targets, "full", rule, task)
        small = _judge(Path(folder), ref, trial, targets, "compact", rule, task)
    assert full[0].quality.trial == 1.0 and full[1].decision == "accept"
    _same_verdict(full, small)


def test_accuracy_and_top1_gates_on_near_ties_at_the_top(tmp_path):
    """The argmax and its ties are kept exactly: a runner-up 1 ulp below the top, or equal to it, decides alike."""
    ref, trial, targets = _near_ties(1)
    trial[:, 0::2, NEIGHBOUR] = torch.nextafter(ref[:, 0::2, TARGET], torch.tensor(-math.inf))
    trial[:, 1::4, NEIGHBOUR] = ref[:, 1::4, TARGET]  # an exact tie at the top, lower index: the label moves
    for tie_rule in ("lowest_index", "tie_is_flip"):
        rule = AcceptanceConfig(outputs=LOOSE, tie_rule=tie_rule, max_quality_drop=0.3, min_top1_agreement=0.8,
                                max_kl_mean=1.0, max_flips=10_000, max_flip_rate=None,
                                loss_noise_multiple=None)
        task = TaskConfig(metric="accuracy")
        full = _judge(tmp_path, ref, trial, targets, "full", rule, task)
        _same_verdict(full, _judge(tmp_path, ref, trial, targets, "compact", rule, task))
        assert full[0].quality.counts["trial"] == ((96, 128) if tie_rule == "lowest_index" else (64, 128))  # (class 950
        # ties the top from behind on tokens 3 mod 4: a label under lowest_index, none under tie_is_flip)


def _near_threshold(tokens=64, labels=8, seed=0):
    """Per-token multi-label logits [2, tokens, labels] decided at 0, each row spanning [-50, 60]: on the trial, one value
    per token lies within a quantum of 0, on the side its 2-byte code would not keep."""
    g = torch.Generator().manual_seed(seed)
    ref = 20.0 + 10.0 * torch.rand(2, tokens, labels, generator=g)
    ref[..., 0], ref[..., 1] = 60.0, -50.0
    ref[..., 2] = -20.0
    trial = ref.clone()
    step = float(compact.encode(ref[:1, :1].numpy())["step"].reshape(-1)[0])
    for v in np.linspace(-step, step, 201):  # a value whose decoded copy crosses 0
        row = ref[:1, :1].clone()
        row[..., 2] = float(v)
        back = compact.decode(compact.encode(row.numpy()))[0, 0, 2]
        if v != 0 and np.sign(back) != np.sign(np.float32(v)):
            break
    else:
        raise AssertionError("no value crosses 0 once decoded")
    trial[..., 2] = float(v)
    targets = (ref > 0).float()
    targets[..., 2] = 1.0 if v > 0 else 0.0  # on the trial's side of 0: a hit
    return ref, trial, targets


def test_label_accuracy_near_its_threshold_is_the_same_under_both_stores(tmp_path):
    ref, trial, targets = _near_threshold()
    task = TaskConfig(kind="regression", loss="bce")
    rule = AcceptanceConfig(outputs={"*": Tolerance(atol=30.0, rtol=0.0)}, threshold=0.0, max_quality_drop=0.01,
                            max_flips=10_000, max_flip_rate=None, max_near_boundary_flips=None,
                            loss_noise_multiple=None)
    full = _judge(tmp_path, ref, trial, targets, "full", rule, task)
    small = _judge(tmp_path, ref, trial, targets, "compact", rule, task)
    assert full[0].quality.metric == "label_accuracy" and full[0].quality.trial == 1.0
    _same_verdict(full, small, store="full")  # a regression's values stay full under compare.store compact


def test_the_compact_store_keeps_the_k_best_of_each_row_exactly_in_their_order():
    """Decoded, the k best of a row (equal scores by lowest index) are the original classes at their original scores,
    and every other class ranks behind them: a target's rank among the k best is exact."""
    ref, trial, _ = _near_ties(5, tokens=16)
    z = trial.numpy()
    parts = compact.encode(z, keep=5)
    back = compact.decode(parts)
    order = np.lexsort((np.broadcast_to(np.arange(V), z.shape), -z), axis=-1)[..., :5]
    assert np.array_equal(parts["best_index"], order)
    assert np.array_equal(np.lexsort((np.broadcast_to(np.arange(V), z.shape), -back), axis=-1)[..., :5], order)
    assert np.array_equal(np.take_along_axis(back, order, -1), np.take_along_axis(z, order, -1))


def test_a_compact_file_of_another_format_or_too_few_kept_classes_is_refused_in_one_line(tmp_path):
    ref, trial, targets = _near_ties(3, tokens=8)
    ids = ["ordinary/0", "ordinary/1"]
    path = tmp_path / "o.safetensors"
    outputs.write_outputs(path, [{"logits": ref}], ids, store="compact", task=TaskConfig(metric="top_k", top_k=3))
    reader = outputs.OutputsReader(path)
    assert reader.kept("logits") == 3
    sources = streams.Sources(ids, targets, torch.ones(2, dtype=torch.bool), reader, reader, reader)
    with pytest.raises(UserError, match="keeps the 3 best") as e:
        streams.compare_streams("classification", AcceptanceConfig(), sources, RUNS,
                                metric=streams.Metric.for_task(TaskConfig(metric="top_k", top_k=4)))
    assert "\n" not in str(e.value)
    old = tmp_path / "old.safetensors"
    outputs.write_outputs(old, [{"logits": ref}], ids, store="compact", meta={"compact_version": 1})
    with pytest.raises(UserError, match="another compact format") as e:
        outputs.OutputsReader(old)
    assert "\n" not in str(e.value)


def test_a_regression_is_never_compacted():
    """Its values are decided at a threshold and scored by their errors: 2 bytes keep neither exactly."""
    shapes, dtypes = {"logits": (512, 64, 32_000)}, {"logits": "float32"}
    assert compact.chosen("compact", shapes, dtypes, kind="regression") == []
    assert compact.chosen("compact", shapes, dtypes) == ["logits"]


def _ranks(z: np.ndarray) -> np.ndarray:
    """Each class's rank in its row: score descending, equal scores by lowest index (top_k's order)."""
    order = np.lexsort((np.broadcast_to(np.arange(z.shape[-1]), z.shape), -z), axis=-1)
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(z.shape[-1]), z.shape), -1)
    return ranks


@pytest.mark.parametrize("keep", [1, 2, 5, 7])
def test_ranks_among_the_k_best_survive_ties_near_ties_masks_and_flat_rows(keep):
    """Rows of many exact ties (rounded scores), runs of 1-ulp neighbours, masked (-inf) classes, a flat row, rows
    with fewer finite scores than kept: every class of rank < keep keeps its rank, every other stays behind them, and
    every decoded score stays within ``logit_error``."""
    g = np.random.default_rng(keep)
    z = (g.standard_normal((6, 20, 64)) * 10).astype(np.float32)
    z[0] = np.round(z[0])  # many exact ties
    z[1] = z[1, :, :1] + np.arange(64, dtype=np.float32)[::-1] * 1e-6 * g.choice([-1, 1], 64)  # within a quantum
    z[2, :, ::3] = -np.inf  # masked
    z[3] = 1.5  # flat
    z[4, :, 3:] = -np.inf  # 3 finite scores per row
    z[5, :, [9, 33, 50]] = z[5].max(-1)  # ties of the top, at several indices
    parts = compact.encode(z, keep=keep)
    back = compact.decode(parts)
    original, decoded = _ranks(z), _ranks(back)
    k = min(keep, 64)
    assert np.array_equal(np.minimum(original, k), np.minimum(decoded, k))
    finite = np.isfinite(z)
    assert np.array_equal(np.isfinite(back), finite) and np.array_equal(back[~finite], z[~finite])
    with np.errstate(invalid="ignore"):  # -inf - -inf where masked: left out
        error = np.abs(np.where(finite, back.astype(np.float64) - z, 0)).max(-1)
    assert (error <= np.vectorize(lambda a, b: compact.logit_error(np.array([a]), np.array([b])))(
        parts["top"], parts["step"])).all()


def _at_a_margin(kind: str, tokens: int = 64, seed: int = 3):
    """[2, tokens, V] reference scores and a ``boundary_margin`` exactly at one token's own ``kind`` margin (the one
    definition's, ``compact.row_lse`` / ``row_spread``), chosen where the margin read from the decoded compact scores
    lies below it: read from them, that token counted near the boundary under ``compact`` and clear under ``full``
    (issue 50.2). The trial swaps that token's best two: its one flip is near or far by that margin alone."""
    from pipeline.compare.decisions import margins

    g = torch.Generator().manual_seed(seed)
    ref = -30.0 * torch.rand(2, tokens, V, generator=g)
    ref[..., 0] = 30.0
    ref[..., 1] = 29.0 + torch.rand(2, tokens, generator=g)
    z, back = ref.numpy().reshape(-1, V), compact.decode(compact.encode(ref.numpy())).reshape(-1, V)
    top = torch.from_numpy(z).topk(2)

    def margin(x):
        stats = {"lse": torch.from_numpy(compact.row_lse(x))} if kind == "probability" else {
            "spread": torch.from_numpy(compact.row_spread(x))}
        return margins(top, kind, stats.get("lse"), torch.from_numpy(x), spread=stats.get("spread"))

    exact, decoded = margin(z), margin(back)
    lower = torch.nonzero(decoded < exact).flatten()
    assert lower.numel(), "no token whose decoded margin lies below its own"
    row = int(lower[0])
    trial = ref.clone().reshape(-1, V)
    trial[row, 0], trial[row, 1] = ref.reshape(-1, V)[row, 1], ref.reshape(-1, V)[row, 0]
    return ref, trial.reshape(ref.shape), float(exact[row])


@pytest.mark.parametrize("kind", ["probability", "relative"])
def test_a_probability_or_relative_margin_at_the_boundary_counts_alike_under_both_stores(tmp_path, kind):
    """A flip whose reference margin is exactly ``boundary_margin`` is far (not below it) under ``full``; under
    ``compact`` its margin read from decoded scores lay below, near: with ``max_near_boundary_flips: null`` compact
    accepted and full rolled back. The compact store keeps each row's log-sum-exp and live spread (issue 50.2)."""
    ref, trial, boundary = _at_a_margin(kind)
    targets = torch.full(ref.shape[:2], 0)
    rule = AcceptanceConfig(outputs=LOOSE, boundary_margin=boundary, boundary_margin_kind=kind, max_flips=0,
                            max_flip_rate=None, max_near_boundary_flips=None, max_quality_drop=1.0, max_kl_mean=10.0,
                            loss_noise_multiple=None)
    task = TaskConfig(metric="accuracy")
    full = _judge(tmp_path, ref, trial, targets, "full", rule, task)
    small = _judge(tmp_path, ref, trial, targets, "compact", rule, task)
    f, s = full[0].flips, small[0].flips
    assert (f.flips, f.near_boundary_flips) == (1, 0) and full[1].decision == "rollback"
    assert (s.flips, s.near_boundary_flips, s.near_boundary_cases) == (f.flips, f.near_boundary_flips,
                                                                        f.near_boundary_cases)
    _same_verdict(full, small)


@pytest.mark.parametrize("kind", ["probability", "relative"])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_the_margin_a_compact_store_keeps_is_the_one_full_settles_at_the_boundary(kind, kernels):
    """``DecisionStats`` on full scores (torch's path or the kernels') and on decoded scores with the stored row
    statistics (``exact``) count the same near cases and flips, at a boundary exactly at a token's margin."""
    from pipeline.compare import native
    from pipeline.compare.decisions import DecisionStats

    if kernels and not native.available():
        pytest.skip("no C compiler: the kernels' path is torch's")
    ref, trial, boundary = _at_a_margin(kind)
    parts = compact.encode(ref.numpy())
    decoded = torch.from_numpy(compact.decode(parts))
    ids, kinds = [f"ordinary/{i}" for i in range(2)], ["ordinary"] * 2
    seen = []
    for scores, exact in ((ref, None), (decoded, (torch.from_numpy(parts["lse"]), torch.from_numpy(parts["spread"])))):
        stats = DecisionStats(ids, kinds, "lowest_index", boundary, kind, ref[..., 0].numel(), kernels=kernels)
        stats.update(0, scores, trial, exact=exact)
        d = stats.result()
        seen.append((d.flips, d.near_boundary_flips, d.near_boundary_cases))
    assert seen[0] == seen[1] and seen[0][:2] == (1, 0)


def test_the_row_statistics_are_the_same_bits_in_any_block_and_follow_live_spread():
    """``row_lse`` and ``row_spread`` of a row do not depend on the rows beside it (the compact store encodes by
    blocks, compare settles by slices), and match torch's ``logsumexp`` and ``decisions.live_spread`` (masked classes,
    one live class, NaN, infinities)."""
    from pipeline.compare.decisions import live_spread
    from pipeline.compare.gaps import ZERO_PROBABILITY_NATS

    assert compact.LIVE_NATS == ZERO_PROBABILITY_NATS
    g = np.random.default_rng(0)
    z = (g.standard_normal((40, 3001)) * 8).astype(np.float32)
    z[1, ::2] = -np.inf
    z[2, 1:] = np.finfo(np.float32).min  # one live class
    z[3, 5] = np.nan
    z[4, 7] = np.inf
    z[5] = -np.inf
    for f in (compact.row_lse, compact.row_spread):
        whole = f(z)
        assert np.array_equal(whole, np.concatenate([f(z[i : i + 1]) for i in range(len(z))]), equal_nan=True)
        assert np.array_equal(whole[7:], f(z[7:]))
    t = torch.from_numpy(z).double()
    assert np.allclose(compact.row_lse(z), torch.logsumexp(t, -1).numpy(), rtol=1e-12, atol=0, equal_nan=True)
    assert np.allclose(compact.row_spread(z), live_spread(t).numpy(), rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.parametrize("gate", ["max_kl_mean", "max_kl_p99"])
def test_kl_gates_under_compact_decide_as_full_outside_the_stated_bound_and_never_accept_more(tmp_path, gate):
    """KL reads every score of both sides together: no statistic of one side, stored beside its codes, gives it
    exactly, so its gates add the store's bound (``kl_mean_bound``, ``kl_p99_bound``). A limit farther from the measured
    KL than that bound gets full's decision; within it, compact rolls back where full accepts, and never the reverse."""
    import statistics

    ref, trial, targets = _near_ties(3)
    trial = trial + 0.05 * torch.randn(trial.shape, generator=torch.Generator().manual_seed(1))
    task = TaskConfig(metric="accuracy")
    base = AcceptanceConfig(outputs=LOOSE, max_flips=10_000, max_flip_rate=None, max_near_boundary_flips=None,
                            max_quality_drop=1.0, loss_noise_multiple=None)
    full, _, _ = _judge(tmp_path, ref, trial, targets, "full", base, task)
    small, _, _ = _judge(tmp_path, ref, trial, targets, "compact", base, task)
    z = statistics.NormalDist().inv_cdf(base.confidence)

    def read(d):
        return (d.kl_mean + z * d.kl_mean_se, d.kl_mean_bound) if gate == "max_kl_mean" else (d.kl_p99_upper,
                                                                                              d.kl_p99_bound)

    (f_value, f_bound), (s_value, s_bound) = read(full.distribution), read(small.distribution)
    assert f_bound == 0.0 and 0.0 < s_bound and abs(s_value - f_value) <= s_bound
    outside = (f_value - 2 * s_bound, f_value + 3 * s_bound, 0.5 * f_value, 2.0 * f_value + 3 * s_bound)
    for limit in outside:
        rule = replace(base, **{gate: limit})
        assert acceptance.decide(small, rule).decision == acceptance.decide(full, rule).decision, limit
    within = replace(base, **{gate: f_value + 0.5 * (s_value + s_bound - f_value)})  # full's value below it, compact's edge above
    assert acceptance.decide(full, within).decision == "accept"
    assert acceptance.decide(small, within).decision == "rollback"
    assert any("store bound" in r for r in acceptance.decide(small, within).reasons)


def _judge_kl(tmp_path, ref, trial, targets, store, rule, task, ids=None, chunk_elements=40_000):
    """``_judge`` as trial@NAME writes its outputs: the reference stored full, the trial under ``store``, a compacted
    trial keeping each token's KL against the reference (``outputs.KlAgainst``: ``decisions.token_kl``, as the stage
    gives it). Returns (stats, decision, the trial's reader)."""
    from pipeline.compare.decisions import token_kl

    n = ref.shape[0]
    ids = ids or [f"ordinary/{i}" for i in range(n)]
    folder = tmp_path / store
    folder.mkdir(exist_ok=True)
    outputs.write_outputs(folder / "reference.safetensors", [{"logits": ref}], ids, task=task)
    reference = outputs.OutputsReader(folder / "reference.safetensors")
    outputs.write_outputs(folder / "trial.safetensors", [{"logits": trial[: n // 2]}, {"logits": trial[n // 2 :]}], ids,
                          store=store, task=task, kl_against=outputs.KlAgainst(lambda: reference, token_kl))
    reader = outputs.OutputsReader(folder / "trial.safetensors")
    sources = streams.Sources(ids, targets, torch.ones(n, dtype=torch.bool), reference, reader, reader)
    stats, table = streams.compare_streams(task.kind, rule, sources, RUNS, metric=streams.Metric.for_task(task),
                                           cfg=CompareConfig(chunk_elements=chunk_elements))
    return stats, acceptance.decide(stats, rule), reader, table


def _gate_value(d, gate: str, rule) -> float:
    """What the gate holds against its limit (``rule.decide``'s expression, the store's bound included)."""
    import statistics

    z = statistics.NormalDist().inv_cdf(rule.confidence)
    if gate == "max_kl_mean":
        return d.kl_mean + z * d.kl_mean_se + d.kl_mean_bound
    return d.kl_p99_upper + d.kl_p99_bound


def _same_kl(full, small):
    """Every number compare derives from KL per token is the same under both stores, with no store bound."""
    (f, _, f_reader, f_table), (s, _, s_reader, s_table) = full, small
    assert (f_reader.store, s_reader.store) == ("full", "compact") and s_reader.kl("logits") is not None
    fd, sd = f.distribution, s.distribution
    for key in ("tokens", "kl_mean", "kl_mean_se", "kl_p99", "kl_p99_upper", "kl_max", "kl_quantiles", "top1_agreement",
                "kl_mean_bound", "kl_p99_bound", "kl_max_bound"):
        assert getattr(sd, key) == getattr(fd, key), key
    assert sd.kl_mean_bound == sd.kl_p99_bound == 0.0 and sd.store == {"reference": "full", "trial": "compact"}
    assert [(f.id, f.position, f.kl) for f in s.flips.flip_list] == [(f.id, f.position, f.kl) for f in f.flips.flip_list]
    keys = ("id", "kl_mean", "kl_max", "worst_token")
    assert [{k: r.get(k) for k in keys} for r in s_table] == [{k: r.get(k) for k in keys} for r in f_table]


def _kl_pair(tokens=64, seed=1):
    """Near ties (``_near_ties``) with a trial moved by noise of 0.05: its decoded compact scores move each token's KL."""
    ref, trial, targets = _near_ties(3, tokens=tokens)
    return ref, trial + 0.05 * torch.randn(trial.shape, generator=torch.Generator().manual_seed(seed)), targets


def _wide_pair(tokens: int, v: int, seed=1):
    """[2, tokens, v] scores over a wide vocabulary, the trial moved by noise of 0.05."""
    g = torch.Generator().manual_seed(seed)
    ref = -30.0 * torch.rand(2, tokens, v, generator=g)
    ref[..., 0] = 30.0
    trial = ref + 0.05 * torch.randn(ref.shape, generator=g)
    return ref, trial, torch.zeros(2, tokens, dtype=torch.long)


KL_BASE = AcceptanceConfig(outputs=LOOSE, max_flips=10_000, max_flip_rate=None, max_near_boundary_flips=None,
                           max_quality_drop=1.0, loss_noise_multiple=None)


@pytest.mark.parametrize("gate", ["max_kl_mean", "max_kl_p99"])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_kl_gates_at_their_limit_decide_as_full_under_compact_both_ways(tmp_path, monkeypatch, gate, kernels):
    """A limit exactly at full's KL mean (upper bound) or p99 accepts under ``full``, and one float below it rolls back:
    under ``compact`` the trial keeps each token's KL of the full scores (``compact.KL``), so the same limits accept and
    roll back alike (before, the decoded scores' KL plus the store's bound rolled back at the first). On torch's path and
    the kernels' (which compare takes for an output of ``native.MIN_ELEMENTS``)."""
    from pipeline.compare import native

    if kernels:
        if not native.available():
            pytest.skip("no C compiler: the kernels' path is torch's")
        monkeypatch.setattr(native, "MIN_ELEMENTS", 1)
    ref, trial, targets = _kl_pair()
    task = TaskConfig(metric="accuracy")
    full = _judge_kl(tmp_path, ref, trial, targets, "full", KL_BASE, task)
    small = _judge_kl(tmp_path, ref, trial, targets, "compact", KL_BASE, task)
    assert bool(full[0].outputs.kernels) == kernels
    _same_kl(full, small)
    at = _gate_value(full[0].distribution, gate, KL_BASE)
    for limit, decision in ((at, "accept"), (math.nextafter(at, -math.inf), "rollback")):
        rule = replace(KL_BASE, **{gate: limit})
        assert acceptance.decide(full[0], rule).decision == decision, limit
        assert acceptance.decide(small[0], rule).decision == decision, limit
    decoded = _judge(tmp_path, ref, trial, targets, "compact", KL_BASE, task)[0].distribution  # (no KL kept: bounded)
    assert _gate_value(decoded, gate, KL_BASE) > at


def test_a_token_kl_is_the_same_bits_in_any_block_of_rows_or_positions():
    """The trial writes KL by its chunks of cases, compare reads scores by slices of positions: torch sums one row over
    its threads in another order (past 32,768 classes), so ``token_kl`` computes a lone row beside a copy of itself."""
    from pipeline.compare import native
    from pipeline.compare.decisions import token_kl

    ref, trial, _ = _wide_pair(3, 40_000)
    trial[1, 1] = ref[1, 1] + 3.0 * torch.randn(40_000, generator=torch.Generator().manual_seed(2))  # far apart
    for elements in (0, native.MIN_ELEMENTS):
        whole = token_kl(ref, trial, 5, elements)
        for i in range(2):
            by_position = torch.cat([token_kl(ref[i : i + 1, p : p + 1], trial[i : i + 1, p : p + 1], 5, elements)
                                     for p in range(3)], 1)
            assert torch.equal(by_position, whole[i : i + 1])


def test_one_position_slices_of_a_large_vocabulary_read_the_kl_the_trial_stored(tmp_path):
    """140,000 classes: compare slices one position at a time, the trial wrote whole cases; at a limit exactly at
    full's mean both stores accept, one float below both roll back."""
    ref, trial, targets = _wide_pair(6, 140_000)
    task = TaskConfig(metric="accuracy")
    full = _judge_kl(tmp_path, ref, trial, targets, "full", KL_BASE, task, chunk_elements=1 << 22)
    small = _judge_kl(tmp_path, ref, trial, targets, "compact", KL_BASE, task, chunk_elements=1 << 22)
    _same_kl(full, small)
    at = _gate_value(full[0].distribution, "max_kl_mean", KL_BASE)
    for limit, decision in ((at, "accept"), (math.nextafter(at, -math.inf), "rollback")):
        rule = replace(KL_BASE, max_kl_mean=limit)
        assert acceptance.decide(small[0], rule).decision == acceptance.decide(full[0], rule).decision == decision


def test_a_trial_beside_a_compact_reference_keeps_no_kl_and_its_gates_add_the_bound(tmp_path):
    """No exact score to measure against: the trial keeps none, and compare adds the store's bound (never accepts more)."""
    from pipeline.compare.decisions import token_kl

    ref, trial, targets = _kl_pair(tokens=8)
    ids = ["ordinary/0", "ordinary/1"]
    task = TaskConfig(metric="accuracy")
    outputs.write_outputs(tmp_path / "r.safetensors", [{"logits": ref}], ids, store="compact", task=task)
    reference = outputs.OutputsReader(tmp_path / "r.safetensors")
    outputs.write_outputs(tmp_path / "t.safetensors", [{"logits": trial}], ids, store="compact", task=task,
                          kl_against=outputs.KlAgainst(lambda: reference, token_kl))
    reader = outputs.OutputsReader(tmp_path / "t.safetensors")
    assert reader.store == "compact" and reader.kl("logits") is None and reader.names == ["logits"]
    sources = streams.Sources(ids, targets, torch.ones(2, dtype=torch.bool), reference, reader, reader)
    d = streams.compare_streams("classification", KL_BASE, sources, RUNS, metric=streams.Metric.for_task(task))[0].distribution
    assert d.kl_mean_bound > 0.0 and d.kl_p99_bound > 0.0
    with pytest.raises(ValueError, match="other cases"):
        outputs.write_outputs(tmp_path / "u.safetensors", [{"logits": trial}], ["a", "b"], store="compact", task=task,
                              kl_against=outputs.KlAgainst(lambda: reference, token_kl))


def test_the_stored_kl_is_hashed_with_the_outputs_and_an_older_trial_is_refused_in_one_line(tmp_path):
    """The KL is a tensor of the trial's file, whose sha256 the manifest holds: changed, the file is refused; a trial of
    the format before (3: no KL) is refused, naming the stage to rerun."""
    from pipeline.compare.decisions import token_kl
    from pipeline.files import sha256_file

    ref, trial, _ = _kl_pair(tokens=8)
    ids = ["ordinary/0", "ordinary/1"]
    outputs.write_outputs(tmp_path / "r.safetensors", [{"logits": ref}], ids)
    reference = outputs.OutputsReader(tmp_path / "r.safetensors")
    path = tmp_path / "t.safetensors"
    sha = outputs.write_outputs(path, [{"logits": trial}], ids, store="compact",
                                kl_against=outputs.KlAgainst(lambda: reference, token_kl))
    reader = outputs.OutputsReader(path, sha, "trial@fp16")
    kl = reader.kl("logits")
    assert kl.dtype == torch.float64 and torch.equal(kl, token_kl(ref, trial, compact.KEEP, ref.numel()))
    numpy_reader = outputs.NumpyReader(path, sha, "trial@fp16")  # (the report's: scores only)
    assert list(numpy_reader.read()) == ["logits"] and numpy_reader.elements_per_case == 8 * V
    raw = bytearray(path.read_bytes())
    raw[reader._offsets[compact.part("logits", compact.KL)]] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError):
        outputs.OutputsReader(path, sha, "trial@fp16")
    old = tmp_path / "old.safetensors"
    outputs.write_outputs(old, [{"logits": trial}], ids, store="compact", meta={"compact_version": 3})
    for reading in (lambda: outputs.OutputsReader(old, sha256_file(old), "trial@fp16"),
                    lambda: outputs.NumpyReader(old, sha256_file(old), "trial@fp16")):
        with pytest.raises(UserError, match="version 3.*rerun trial@fp16") as e:
            reading()
        assert "\n" not in str(e.value)
