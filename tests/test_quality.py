"""Quality on hand-built outputs: accuracy, top_k, regression errors, per-token accuracy and perplexity."""

import math

import pytest
import torch

from pipeline.compare.quality import QualityStats, regression_errors
from pipeline.errors import UserError


def _once(metric, outputs, targets, top_k=5):
    q = QualityStats(metric, "lowest_index", top_k)
    q.update(outputs, targets)
    return q


def test_regression_errors_and_extremes():
    y = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0])
    p = torch.tensor([0.0, 1.0, 2.0, 3.0, 8.0])
    e = regression_errors(p, y, extreme_quantile=0.2)
    assert e.mae == pytest.approx(0.4)
    assert e.rmse == pytest.approx(math.sqrt(4 / 5))
    assert e.max_error == 2.0
    assert e.extreme_high_mae == 2.0 and e.extreme_low_mae == 0.0
    assert e.output_max == 8.0


def test_quality_metrics():
    scores = torch.tensor([[0.0, 1.0, 2.0], [3.0, 2.0, 1.0]])
    y = torch.tensor([1, 0])
    accuracy = _once("accuracy", scores, y)
    assert accuracy.result() == 0.5 and accuracy.counts() == (1, 2) and accuracy.perplexity() is None
    assert _once("top_k", scores, y, top_k=2).result() == 1.0
    pred, target = torch.tensor([[1.0], [3.0]]), torch.tensor([[1.0], [1.0]])
    assert _once("neg_mae", pred, target).result() == -1.0
    assert _once("neg_rmse", pred, target).result() == pytest.approx(-math.sqrt(2))
    assert _once("neg_rmse", pred, target).counts() is None
    # per token: token accuracy and perplexity over targets != -100
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
    tokens = torch.tensor([[0, 0, -100]])
    acc = _once("accuracy", logits, tokens)
    assert acc.result() == 1.0
    assert acc.perplexity() == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.9)) / 2))


def test_quality_streams_to_the_same_answer_and_returns_its_hits():
    g = torch.Generator().manual_seed(5)
    scores, y = torch.randn(100, 4, generator=g), torch.randint(0, 4, (100,), generator=g)
    whole = _once("accuracy", scores, y)
    parts = QualityStats("accuracy", "lowest_index")
    hits = torch.cat([parts.update(s, t) for s, t in zip(scores.split(7), y.split(7))])
    assert parts.counts() == whole.counts() == (int(hits.sum()), 100)
    assert hits.tolist() == (scores.argmax(-1) == y).tolist()


def test_a_user_metric_is_called_once_on_every_target_row():
    calls = []

    def error_rate(out, target):
        calls.append(out.shape[0])
        return float((out.argmax(-1) != target).double().mean())

    q = QualityStats("mypkg:error_rate", "lowest_index", user=error_rate)
    scores = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    for s, t in zip(scores.split(2), torch.tensor([1, 1, 1]).split(2)):
        assert q.update(s, t) is None
    assert q.result() == pytest.approx(1 / 3) and calls == [3] and q.counts() is None
    bad = QualityStats("mypkg:shape", "lowest_index", user=lambda out, target: out)
    bad.update(scores, torch.tensor([1, 1, 1]))
    with pytest.raises(UserError, match="task.metric returned Tensor"):
        bad.result()


def test_an_eval_target_outside_the_classes_is_one_line_not_an_index_error():
    stats = QualityStats("accuracy", "lowest_index")
    scores = torch.randn(2, 3, 5)
    with pytest.raises(UserError, match="eval target is 7 but the model scores 5 classes"):
        stats.update(scores, torch.tensor([[1, -100, 7], [0, 2, 4]]))
    stats.update(scores, torch.tensor([[1, -100, 4], [0, 2, 4]]))  # -100 is ignored, not out of range


def test_a_user_metric_may_return_a_numpy_scalar_but_not_a_list_or_a_bool():
    """``f(scores, targets)`` written with numpy returns np.float32, np.int64 or a 0-d array: one number each, read
    as such (they were refused with "returned float32 (); return one number"); a list or a bool is no metric value."""
    import numpy as np

    scores, y = torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.tensor([0, 1])
    for value, expected in ((np.float32(0.75), 0.75), (np.int64(2), 2.0), (np.array(0.5), 0.5), (torch.tensor([0.25]), 0.25)):
        q = QualityStats("accuracy", "lowest_index", user=lambda o, t, v=value: v)
        q.update(scores, y)
        assert q.result() == expected
    for value in ([0.5], True, np.bool_(True)):
        q = QualityStats("accuracy", "lowest_index", user=lambda o, t, v=value: v)
        q.update(scores, y)
        with pytest.raises(UserError, match="return one number"):
            q.result()
