"""pipeline/probe.py: freeze's probe takes every legitimate model (a train-mode BatchNorm, a layer that normalises over
the batch), repeats the fixed set's first batch as inference batches it, and refuses a reference whose first training
updates do not reproduce themselves, in one line naming the step and the tensor (issue 48)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline import checkpoint, inference, probe, training
from pipeline.config import Policy, ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.task import TensorSource

CPU = torch.device("cpu")
TASK = TaskConfig(kind="classification", model="m:build")
REF = ReferenceConfig(train_steps=6, batch_size=8, checkpoint_every=0)


def _data(n: int = 32, features: int = 16, seed: int = 2) -> TensorSource:
    g = torch.Generator().manual_seed(seed)
    return TensorSource(torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g))


def _batchnorm(track_running_stats: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8, track_running_stats=track_running_stats),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3))


class NoiseOnLargeBatches(torch.nn.Linear):
    """Numpy noise only on batches above two rows: two training samples never see it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = np.random.standard_normal(x.shape[0]) if x.shape[0] > 2 else np.zeros(x.shape[0])
        return super().forward(x) + torch.from_numpy(noise).float()[:, None]


class NumpyMask(torch.nn.Module):
    """A dropout-like training mask drawn from numpy's global generator, which no torch seed reaches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(16, 32), torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if self.training:
            h = h * torch.from_numpy(np.random.rand(*h.shape) > 0.2).float() / 0.8
        return self.out(h)


@pytest.mark.parametrize("track", [True, False], ids=["running stats", "batch stats only"])
def test_a_batchnorm_model_in_train_mode_passes_the_probe(track) -> None:
    """Train mode at inference (reference.eval_mode: false) cannot take one row, nor can a BatchNorm without running
    statistics in any mode: neither is refused for it, and the fixed set's first batch reproduces."""
    source = _data()
    model = _batchnorm(track)
    assert probe.check(model, source, TASK, CPU, eval_mode=False, fixed=source.x[:20]) is False
    probe.check_training(model, checkpoint.capture(model), source, REF, TASK, CPU, seed=0)


def test_a_forward_drawing_from_numpy_on_large_batches_is_refused_on_the_fixed_sets_first_batch() -> None:
    """Two samples passed it, and an FP32 variant was rolled back on 26 flips of its draws."""
    source, model = _data(), NoiseOnLargeBatches(16, 3)
    probe.check(model, source, TASK, CPU, eval_mode=True)  # the two training samples alone cannot see it
    with pytest.raises(UserError) as err:
        probe.check(model, source, TASK, CPU, eval_mode=True, fixed=source.x[:20])
    line = str(err.value)
    assert "\n" not in line
    for words in ("task.model m:build: the model's forward is not deterministic", "over the fixed set's first batch (20 "
                  "cases)", "at output 'output'", "not numpy, random or a generator of your own"):
        assert words in line, line


def test_the_probe_repeats_the_first_batch_as_inference_batches_it() -> None:
    """At most ``BATCH_ROWS`` rows: the first batch every inference pass runs, one batch of memory whatever the set."""
    seen: list[int] = []

    class Sizes(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.shape[0])
            return super().forward(x)

    source = _data(n=8)
    probe.check(Sizes(16, 3), source, TASK, CPU, eval_mode=True, fixed=torch.randn(inference.BATCH_ROWS + 40, 16))
    assert seen.count(inference.BATCH_ROWS) == 2 and max(seen) == inference.BATCH_ROWS, seen


def test_a_training_drawing_from_numpy_is_refused_in_one_line_naming_the_step_and_tensor() -> None:
    source, model = _data(), NumpyMask()
    init = checkpoint.capture(model)
    probe.check(model, source, TASK, CPU, eval_mode=True, fixed=source.x[:20])  # inference draws nothing: it passes
    with pytest.raises(UserError) as err:
        probe.check_training(model, init, source, REF, TASK, CPU, seed=0)
    line = str(err.value)
    assert "\n" not in line
    for words in ("task.model m:build: the FP32 reference's training does not reproduce itself", "first 2 updates",
                  "first at step 1's loss", "in tensor 'inp.weight'", "seed the generator the model draws from",
                  "mask_time_prob: 0"):
        assert words in line, line
    assert checkpoint.tensors_digest(checkpoint.capture(model).tensors) == checkpoint.tensors_digest(init.tensors)


def _trained(model: torch.nn.Module, init: checkpoint.Checkpoint, source: TensorSource) -> str:
    checkpoint.restore(init, model)
    result = training.train(model, source, REF, TASK, Policy(), CPU, seed=0, label="reference")
    return checkpoint.tensors_digest(result.state.tensors) + repr([r.loss for r in result.records])


def test_a_deterministic_reference_passes_and_trains_to_the_same_bytes_as_without_the_check() -> None:
    """torch's own draws (dropout) are seeded alike in both runs; the check leaves weights and torch's RNG as it found
    them, so the reference's bytes (weights, optimizer, RNG) and losses are those of a run without it."""
    source = _data()

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                   torch.nn.Dropout(0.3), torch.nn.Linear(32, 3))

    model = build()
    init = checkpoint.capture(model)
    without = _trained(model, init, source)
    fresh = build()
    probe.check_training(fresh, init, source, REF, TASK, CPU, seed=0)
    assert torch.equal(torch.get_rng_state(), init.tensors["rng/cpu"])
    assert _trained(fresh, checkpoint.capture(fresh), source) == without  # from the state the check left


def test_a_wav2vec2_with_spec_augment_is_refused_and_passes_without_it() -> None:
    """A Hugging Face Wav2Vec2's SpecAugment draws its training masks from numpy's unseeded global generator: six runs
    of identical params gave bfloat16 rollback, accept, accept, rollback, accept, accept."""
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    source = TensorSource(torch.randn(16, 400, generator=g), torch.randint(0, 3, (16,), generator=g))
    task = TaskConfig(kind="classification", model="m:wav2vec2")
    ref = ReferenceConfig(train_steps=4, batch_size=8, optimizer="adamw", lr=1e-3, checkpoint_every=0)

    def build(mask_time_prob: float) -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.Wav2Vec2ForSequenceClassification(transformers.Wav2Vec2Config(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
            conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
            num_labels=3, classifier_proj_size=8, mask_time_prob=mask_time_prob))

    masked = build(0.05)  # the default
    with pytest.raises(UserError, match=r"^task\.model m:wav2vec2: the FP32 reference's training does not reproduce "
                                        r"itself: .* first at step 1's loss .* in tensor '[\w.]+'") as err:
        probe.check_training(masked, checkpoint.capture(masked), source, ref, task, CPU, seed=0)
    assert "\n" not in str(err.value)
    plain = build(0.0)
    probe.check(plain, source, task, CPU, eval_mode=True, fixed=source.x[:8])
    probe.check_training(plain, checkpoint.capture(plain), source, ref, task, CPU, seed=0)
