"""Scores over positions (an extractive QA head) against scores over classes that happen to be as many as the padded
length: only a head whose name says an answer's ends is read over the real positions (``streams.position_heads``)."""

from __future__ import annotations

import torch
import transformers

from pipeline import rule
from pipeline.compare import streams
from pipeline.config import AcceptanceConfig, TaskConfig
from pipeline.task import Batch

from tests._steps import step

RULE = AcceptanceConfig(min_quality=None, loss_noise_multiple=None)


def _compare(name: str, ref: torch.Tensor, trial: torch.Tensor, y: torch.Tensor, mask: torch.Tensor):
    n = ref.shape[0]
    flat = [step(i) for i in range(12)]
    src = streams.Sources([f"ordinary/s{i}" for i in range(n)], y, torch.ones(n, dtype=torch.bool),
                          streams.InMemory({name: ref}), streams.InMemory({name: trial}), streams.InMemory({name: trial}),
                          token_mask=mask)
    stats, _ = streams.compare_streams("classification", RULE, src, streams.Trajectories(flat, flat, 1.0),
                                       metric=streams.Metric.for_task(TaskConfig(kind="classification")))
    return [f.id for f in stats.flips.flip_list], rule.decide(stats, RULE).decision


def test_a_classifier_with_as_many_classes_as_the_padded_length_keeps_its_columns():
    """A sequence classifier of 16 classes over texts padded to 16 tokens, most truncated to full length, six short
    ones whose labels happen to lie within their lengths: shapes and targets are a QA head's. Read over positions,
    class 15 of a short case was -inf, and a trial moving that case there was accepted."""
    t = c = 16
    n = 300
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=c)
    model = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        model.classifier.weight.mul_(200.0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 60, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    with torch.no_grad():
        labels = model(input_ids=ids, attention_mask=mask).logits.argmax(1)
    short = [i for i in range(n) if int(labels[i]) < 11][:6]
    for i in short:  # padded after a length past its label
        mask[i, int(torch.randint(int(labels[i]) + 1, t - 1, (1,), generator=g)):] = 0
    with torch.no_grad():
        ref = model(**Batch(input_ids=ids * mask, attention_mask=mask)).logits
    y = ref.argmax(1)
    victim = short[0]
    assert int(mask[victim].sum()) < t - 1 and int(y[victim]) < int(mask[victim].sum())  # the shapes of a QA head
    trial = ref.clone()
    trial[victim, t - 1] = ref[victim].max() + 5.0  # the trial answers class 15 for this case
    assert _compare("logits", ref, trial, y, mask) == ([f"ordinary/s{victim}"], "rollback")
    # The same tensors named as an answer's start are scores over positions: class 15 is padding of that case, no flip.
    assert _compare("start_logits", ref, trial, y, mask) == ([], "accept")
