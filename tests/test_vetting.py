"""vetting.Scan: what freeze vets the rule against, gathered while the reference's outputs stream to disk."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from pipeline import cases, rule, vetting
from pipeline.compare import streams
from pipeline.config import load_params

ROOT = Path(__file__).resolve().parents[1]


def _scan(chunks, fixed):
    scan = vetting.Scan(load_params(ROOT / "params.yaml"), fixed)
    row = 0
    for chunk in chunks:
        scan.update(row, chunk)
        row += chunk["output"].shape[0]
    return scan


@pytest.mark.parametrize("per_token", [False, True])
def test_the_scan_of_slices_of_rows_is_the_scan_of_whole_chunks(monkeypatch, per_token):
    """An LM's chunk is GBs: the scan squares and scores it a slice of rows at a time, and gets the same RMS, shapes
    and quality as from whole chunks, whichever rows have a target and wherever the chunks and slices end."""
    gen = torch.Generator().manual_seed(0)
    n, shape = 50, ((6, 10) if per_token else (10,))
    out, aux = torch.randn(n, *shape, generator=gen), torch.randn(n, 3, generator=gen) * 5
    y = out.argmax(-1)
    y[::3] = torch.randint(0, 10, y[::3].shape, generator=gen)  # a third of them mislabeled: quality below 1
    has_target = torch.arange(n) % 4 != 0
    fixed = cases.Cases(ids=[f"ordinary/{i}" for i in range(n)], x=torch.randn(n, 4), y=y, has_target=has_target)
    chunks = [{"output": out[a:b], "aux": aux[a:b]} for a, b in ((0, 23), (23, 50))]
    whole = _scan(chunks, fixed)
    monkeypatch.setattr(vetting, "SLICE_ELEMENTS", 7 * math.prod(shape))  # 7 rows of the primary output per slice
    sliced = _scan(chunks, fixed)
    assert sliced.shapes == whole.shapes == {"output": shape, "aux": (3,)}
    for name in ("output", "aux"):
        assert math.isclose(sliced.rms()[name], whole.rms()[name], rel_tol=1e-12)
    expected = float((out.argmax(-1) == y)[has_target].double().mean())
    assert math.isclose(whole.quality.result(), expected, rel_tol=1e-12)
    assert math.isclose(sliced.quality.result(), expected, rel_tol=1e-12)


def test_an_outputs_scale_is_its_scale_on_the_ordinary_cases_too(monkeypatch):
    """A regression whose outputs are about 0.01 on the application's cases, and the fixed set prepare builds around
    them (``cases.edge_cases``: inputs x1e-4 and x100). Over the whole set the x100 cases give an RMS 7x larger, under
    which the default atol 0.05 passed freeze, and a trial that answers 0 on every ordinary case was accepted. The scale
    an atol must be below is also the ordinary cases' (the smaller of the two), whatever the slices."""
    from pipeline.config import AcceptanceConfig, Params, PrepareConfig, TaskConfig

    from _steps import step

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 2, bias=False))
    with torch.no_grad():
        net[2].weight.mul_(0.05)
    x = torch.randn(256, 8)
    ordinary = cases.Cases(ids=[f"ordinary/{i}" for i in range(256)], x=x, y=torch.zeros(256, 2),
                           has_target=torch.ones(256, dtype=torch.bool))
    fixed = ordinary + cases.edge_cases(ordinary, torch.randn(1000, 8), PrepareConfig(), ordinary.y)
    with torch.no_grad():
        ref = net(fixed.x)
    fixed = cases.Cases(ids=fixed.ids, x=fixed.x, y=ref + 0.02 * torch.randn(ref.shape), has_target=fixed.has_target)
    on_ordinary = float(ref[:256].double().square().mean().sqrt())
    assert float(ref.square().mean().sqrt()) > 5 * on_ordinary  # the case: edge cases set the pooled scale
    params = Params(task=TaskConfig(kind="regression", loss="mse"),
                    acceptance=AcceptanceConfig(min_quality=None, loss_noise_multiple=None))
    for limit in (vetting.SLICE_ELEMENTS, 50):  # whole chunks, then slices of 25 rows that cut across the kinds
        monkeypatch.setattr(vetting, "SLICE_ELEMENTS", limit)
        scan = vetting.Scan(params, fixed)
        scan.update(0, {"output": ref[:300]})
        scan.update(300, {"output": ref[300:]})
        assert math.isclose(scan.rms()["output"], on_ordinary, rel_tol=1e-9)
        columns = ref[:256].double().square().mean(0).sqrt().tolist()
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(scan.column_rms()["output"], columns))
        line = scan.problem([step(0, 1.0)])
        assert "atol 0.05 is not below the scale" in line and f"RMS {on_ordinary:.3g}" in line, line


def test_the_units_of_the_flip_rates_sample_are_its_ordinary_cases_per_token_their_kept_positions():
    """What ``max_flip_rate``'s bound at freeze counts: compare's sample (``decisions.rate_sample``), the ordinary cases
    (not edge, selected or ``boundary``), per token the positions whose target is not ignored (-100)."""
    ids = [f"ordinary/{i}" for i in range(6)] + ["edge/zeros", "boundary/0~1", "selected/2"]
    n = len(ids)
    per_case = cases.Cases(ids=ids, x=torch.zeros(n, 2), y=torch.zeros(n, dtype=torch.long),
                           has_target=torch.ones(n, dtype=torch.bool))
    scan = _scan([{"output": torch.randn(n, 4)}], per_case)
    assert scan.real_units() == 6
    y = torch.zeros(n, 5, dtype=torch.long)
    y[0, 3:] = -100  # two ignored positions of an ordinary case
    y[7, :] = -100  # a constructed case: not counted whatever its targets
    per_token = cases.Cases(ids=ids, x=torch.zeros(n, 5), y=y, has_target=torch.ones(n, dtype=torch.bool))
    scan = _scan([{"output": torch.randn(n, 5, 4)}], per_token)
    assert scan.real_units() == 6 * 5 - 2


def _vetted(params, x, y, outputs, rows=100):
    """``Scan.problem`` of ``outputs`` streamed in chunks of ``rows``, for the fixed set of inputs ``x`` and targets ``y``."""
    from _steps import step

    n = y.shape[0]
    scan = vetting.Scan(params, cases.Cases(ids=[f"ordinary/{i}" for i in range(n)], x=x, y=y,
                                            has_target=torch.ones(n, dtype=torch.bool)))
    for a in range(0, n, rows):
        scan.update(a, {name: v[a : a + rows] for name, v in outputs.items()})
    return scan.problem([step(0, 1.0)])


class _Masked(torch.nn.Module):
    """A regression's value beside scores of 6 actions, the last two illegal: ``masked_fill(~allowed, fill)``, by default
    the dtype's minimum (-3.4e38 under FP32, -65504 under a float16 trial)."""

    def __init__(self, name: str, fill: float | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.body, self.value, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1), torch.nn.Linear(32, 6)
        self.name, self.fill = name, fill
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.head.weight.mul_(3.0)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        s = self.head(h)
        allowed = torch.ones_like(s, dtype=torch.bool)
        allowed[:, 4:] = False
        return {"output": self.value(h), self.name: s.masked_fill(~allowed, torch.finfo(s.dtype).min if self.fill is None
                                                                   else self.fill)}


def _outputs(model, x, dtype=None):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(x) if torch.is_tensor(x) else model(**x)
    return {k: v.float() for k, v in out.items()}


def test_a_regressions_masked_scores_must_say_whether_they_are_decided():
    """A regression's second head of action scores, illegal actions masked with the dtype's minimum, under a name that
    says no class scores ('policy_scores'). Judged by values, every healthy float16 trial rolled back on the masked pairs
    (-65504 against -3.4e38); decided, such pairs agree (at probability 0 on both sides). freeze used to say nothing; it
    now asks, in one line naming the output and both fixes, whatever the mask (the minimum, or -inf)."""
    from pipeline.config import AcceptanceConfig, Params, TaskConfig, Tolerance

    from _steps import step

    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(6))

    def params(outputs):
        return Params(task=TaskConfig(kind="regression", loss="mse"),
                      acceptance=AcceptanceConfig(min_quality=None, loss_noise_multiple=None, outputs=outputs))

    for fill in (None, -math.inf):
        model = _Masked("policy_scores", fill)
        ref = _outputs(model, x)
        y = ref["output"] + 0.1 * torch.randn(300, 1, generator=torch.Generator().manual_seed(7))
        line = _vetted(params({"*": Tolerance()}), x, y, ref)
        assert line.startswith("params.yaml: output 'policy_scores' of the regression holds masked scores like logits"), line
        assert "{decisions: true}" in line and "{decisions: false}" in line and "-65504" in line and "\n" not in line
        assert _vetted(params({"*": Tolerance(), "policy_scores": Tolerance(decisions=True)}), x, y, ref) is None
        assert _vetted(params({"*": Tolerance(), "policy_scores": Tolerance(decisions=False)}), x, y, ref) is None
    assert _vetted(params({"*": Tolerance()}), x, y, {**ref, "policy_scores": ref["policy_scores"][:, :4]}) is None  # none
    # Why it asks: the healthy float16 trial of the first model passes decided, and fails judged by values.
    model = _Masked("policy_scores")
    ref, trial = _outputs(model, x), _outputs(model, x, torch.float16)
    y = ref["output"] + 0.1 * torch.randn(300, 1, generator=torch.Generator().manual_seed(7))
    for decisions, verdict in ((True, "accept"), (False, "rollback")):
        rule_ = params({"*": Tolerance(), "policy_scores": Tolerance(decisions=decisions)}).acceptance
        sources = streams.Sources([f"ordinary/{i}" for i in range(300)], y, torch.ones(300, dtype=torch.bool),
                                  streams.InMemory(ref), streams.InMemory(trial), streams.InMemory(trial))
        steps = [step(i, 1.0) for i in range(4)]
        stats, _ = streams.compare_streams("regression", rule_, sources, streams.Trajectories(steps, steps, 1.0))
        assert rule.decide(stats, rule_).inference == verdict, (decisions, rule.decide(stats, rule_).reasons)


def test_a_masking_value_is_far_below_any_score_or_minus_infinity_beside_a_score():
    """``masking_value``: the lowest masking value of class scores, None where they hold none (a row of -inf alone
    masks nothing; -1e4 is a score, not ``finfo(float32).min``)."""
    scores = torch.nn.Linear(4, 3)(torch.randn(5, 4)).detach()
    assert vetting.masking_value(scores) is None
    assert vetting.masking_value(scores.masked_fill(scores < 0, -1e4)) is None
    assert vetting.masking_value(scores.masked_fill(scores < 0, torch.finfo(torch.float32).min)) == -3.4028234663852886e38
    assert vetting.masking_value(torch.where(torch.arange(3) == 2, -math.inf, scores)) == -math.inf
    assert vetting.masking_value(torch.full((2, 3), -math.inf)) is None


class _Frames(torch.nn.Module):
    """A sequence classifier ('logits' [N, 5]) with a per-position head from a Conv1d, 'frame_logits' [N, 3, L] as the
    Conv1d gives it (channels first, what CrossEntropyLoss takes with targets [N, L]), or transposed to [N, L, 3].
    ``tokens``: over token ids and an attention_mask (a Hugging Face batch), else over a sequence [N, 4, L]."""

    def __init__(self, tokens: bool, transpose: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed, self.conv = torch.nn.Embedding(50, 4), torch.nn.Conv1d(4, 16, 3, padding=1)
        self.frame, self.cls = torch.nn.Conv1d(16, 3, 1), torch.nn.Linear(16, 5)
        self.tokens, self.transpose = tokens, transpose
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.frame.weight.mul_(0.05)  # low-margin frame classes: bfloat16 flips some
            self.frame.bias.zero_()

    def forward(self, x=None, input_ids=None, attention_mask=None):
        if self.tokens:
            kept = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            x = self.embed(input_ids).transpose(1, 2) * kept[:, None]
        h = torch.tanh(self.conv(x))  # [N, 16, L]
        frames = self.frame(h)
        return {"logits": self.cls(h.mean(-1)), "frame_logits": frames.transpose(1, 2) if self.transpose else frames}


def test_a_decided_head_whose_classes_are_its_axis_1_is_refused_where_the_positions_are_known():
    """A decided [N, C, L] head is read with argmax over its last axis, the positions: bfloat16 flips the class of
    frames over axis 1, and no flip was counted (the last axis' argmax does not move). Where the task says its length
    (the batch's attention_mask, token ids, a sequence input [N, channels, L]), freeze refuses in one line naming the
    output and the fixes; [N, L, C] (a Hugging Face token-classification head beside a sequence primary) passes, and
    with no length known (a per-case input) [N, T, C] and [N, C, T] cannot be told apart: nothing is refused."""
    from pipeline.config import AcceptanceConfig, Params, Tolerance

    params = Params(acceptance=AcceptanceConfig(min_quality=None, loss_noise_multiple=None))
    g = torch.Generator().manual_seed(4)
    sequence = torch.randn(300, 4, 40, generator=g)
    ids = torch.randint(0, 50, (300, 40), generator=g)
    mask = torch.ones(300, 40, dtype=torch.long)
    mask[::3, 30:] = 0
    for x, where in ((sequence, "the input's length, [N, 4, 40]"), ({"input_ids": ids, "attention_mask": mask},
                                                                     "the batch's attention_mask"),
                     ({"input_ids": ids}, "the input's token ids")):
        model = _Frames(tokens=not torch.is_tensor(x))
        ref = _outputs(model, x)
        y = ref["logits"].argmax(1)
        line = _vetted(params, x, y, ref)
        assert line.startswith("params.yaml: output 'frame_logits' of shape [N, 3, 40] is decided by the argmax"), line
        assert f"the task's 40 positions ({where})" in line and ".transpose(1, 2)" in line and "\n" not in line
        assert "'frame_logits': {decisions: false}" in line
        said = dataclasses.replace(params, acceptance=dataclasses.replace(
            params.acceptance, outputs={"*": Tolerance(), "frame_logits": Tolerance(decisions=False)}))
        assert _vetted(said, x, y, ref) is None
        assert _vetted(params, x, y, {**ref, "frame_logits": ref["frame_logits"].transpose(1, 2)}) is None  # [N, L, 3]
        if torch.is_tensor(x):  # the sequence: bfloat16 flips frame classes, over axis 1, which the last axis' argmax misses
            trial = _outputs(model, x, torch.bfloat16)
            assert int((trial["frame_logits"].argmax(1) != ref["frame_logits"].argmax(1)).sum()) > 0
    pooled = torch.randn(300, 8, generator=g)  # a per-case input: no length known
    assert _vetted(params, pooled, y, {"logits": ref["logits"], "frame_logits": ref["frame_logits"]}) is None


class _Flagged(torch.nn.Module):
    """Class scores beside a single-logit head 'flag' (a sigmoid's logit, decided at 0) whose values on the fixed set
    happen to lie in [0, 0.4] (every case class 1, some barely); per token [N, T, 1] where ``tokens``."""

    def __init__(self, name: str, tokens: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.body, self.main, self.flag = torch.nn.Linear(16, 32), torch.nn.Linear(32, 3), torch.nn.Linear(32, 1)
        self.name, self.tokens = name, tokens
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.flag.weight.mul_(0.01)
            self.flag.bias.fill_(0.13)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {"logits": self.main(h.mean(1) if self.tokens else h), self.name: self.flag(h)}


def test_a_single_value_head_in_zero_one_must_say_probability_or_logit():
    """compare reads a single-value head whose name says neither as a probability (decided at 0.5) where every
    reference value lies in [0, 1]: a logit head that happens to stay in [0, 0.4] was decided at 0.5, and a trial moving
    its logits below 0, a changed decision, counted no flip. freeze refuses the guess in one line naming the output and
    the fixes; a name that says which, ``decisions: false``, values outside [0, 1], or only 0s and 1s (read the same
    either way) pass. Per token, only the positions the attention_mask keeps count, as in compare."""
    from pipeline.config import AcceptanceConfig, Params, Tolerance

    params = Params(acceptance=AcceptanceConfig(min_quality=None, loss_noise_multiple=None))
    x = torch.randn(400, 16, generator=torch.Generator().manual_seed(5))
    ref = _outputs(_Flagged("flag"), x)
    y = ref["logits"].argmax(1)
    assert 0 < float(ref["flag"].min()) and float(ref["flag"].max()) < 0.4  # the case
    line = _vetted(params, x, y, ref)
    assert line.startswith("params.yaml: output 'flag' holds one decision per case (or token) as a single value"), line
    assert "'flag_prob'" in line and "'flag_logit'" in line and "'flag': {decisions: false}" in line and "\n" not in line
    for name in ("flag_logit", "flag_prob"):
        assert _vetted(params, x, y, _outputs(_Flagged(name), x)) is None
    said = dataclasses.replace(params, acceptance=dataclasses.replace(
        params.acceptance, outputs={"*": Tolerance(), "flag": Tolerance(atol=1e-4, rtol=0.0, decisions=False)}))
    assert _vetted(said, x, y, ref) is None  # values only, within a tolerance below their spread
    assert _vetted(params, x, y, {**ref, "flag": ref["flag"] - 0.2}) is None  # of both signs: a logit
    assert _vetted(params, x, y, {**ref, "flag": (ref["flag"] > 0.13).float()}) is None  # a bool: 0s and 1s
    tokens = torch.randn(400, 6, 16, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(400, 6, dtype=torch.long)
    mask[:, 4:] = 0
    per_token = _outputs(_Flagged("flag", tokens=True), tokens)
    per_token["flag"][:, 4:] = -3.0  # the padding, out of [0, 1]: not read
    line = _vetted(params, {"x": tokens, "attention_mask": mask}, y, per_token)
    assert line is not None and line.startswith("params.yaml: output 'flag' holds one decision"), line
