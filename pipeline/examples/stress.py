"""Stress examples that make autocast fail in known ways, so the diagnosis has something to find.

Both follow the task contract (``load_data(**options)``, ``build_model(**options)``) with data drawn
from a seeded generator: nothing is downloaded, the same options always give the same tensors.

- Overflow (classification): a layer named ``amplify`` produces activations around 1e5, beyond
  float16's largest finite value (65504), and a LayerNorm brings them back to unit scale. It stands for
  any un-normalised intermediate (a residual stream that grew, a sum over many tokens) that BF16's
  FP32-sized exponent range absorbs and FP16's does not. The FP32 reference is finite; FP16 autocast
  turns ``amplify``'s output into inf, then NaN; BF16 is close to the reference.
- Underflow (regression): targets in small units (around 1e-3) and a head with weights of the same
  scale, so the gradient that reaches ``body`` is around 1e-10: below float16's smallest subnormal
  (6e-8) it becomes zero without loss scaling, and survives with the GradScaler's 65536.

- Compiler drift (classification, the blobs above): ``DriftNet`` adds ``compile_drift`` to class 0's logit when
  it runs compiled in reduced precision, and nowhere else. It stands for a compiler that changes a model's
  reduced-precision numerics (pytorch#168126: compiled bf16 against eager, rtol up to 1e5): eager bf16 and
  compiled FP32 are the model itself, compiled bf16 is not. The diagnosis must blame compile, not precision.

Run them with the params files in ``examples/`` (see docs/diagnostics.md and docs/variants.md).
"""

from __future__ import annotations

import torch


def _blobs(n: int, features: int, classes: int, gen: torch.Generator, centers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.arange(n) % classes
    y = y[torch.randperm(n, generator=gen)]
    return centers[y] + torch.randn(n, features, generator=gen), y


def load_overflow_data(
    n_train: int = 1024, n_eval: int = 256, features: int = 16, classes: int = 4, seed: int = 0, separation: float = 3.0,
    **_: object,
) -> dict:
    """Gaussian blobs around well-separated centres (``separation`` times a standard normal draw): an easy task, so
    any failure is numerical."""
    gen = torch.Generator().manual_seed(seed)
    centers = separation * torch.randn(classes, features, generator=gen)
    train_x, train_y = _blobs(n_train, features, classes, gen, centers)
    eval_x, eval_y = _blobs(n_eval, features, classes, gen, centers)
    return {
        "train_x": train_x,
        "train_y": train_y,
        "eval_x": eval_x,
        "eval_y": eval_y,
        "eval_ids": [f"blob-{i:04d}" for i in range(n_eval)],
    }


class OverflowNet(torch.nn.Module):
    """embed -> ReLU -> amplify (large weights) -> LayerNorm -> head."""

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4, gain: float = 3.0e4) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(features, hidden)
        self.act = torch.nn.ReLU()
        self.amplify = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, classes)
        with torch.no_grad():
            # LayerNorm divides the gradient by the same large scale, so training keeps these weights large.
            self.amplify.weight.mul_(gain)
            self.amplify.bias.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.amplify(self.act(self.embed(x)))))


def build_overflow_model(
    features: int = 16, hidden: int = 64, classes: int = 4, gain: float = 3.0e4, **_: object
) -> torch.nn.Module:
    return OverflowNet(features, hidden, classes, gain)


def load_underflow_data(
    n_train: int = 1024, n_eval: int = 256, features: int = 16, target_scale: float = 1.0e-3, seed: int = 0, **_: object
) -> dict:
    """A smooth regression target, expressed in small units (``target_scale``)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=gen) / features**0.5
    x = torch.randn(n_train + n_eval, features, generator=gen)
    y = (target_scale * torch.tanh(x @ w)).unsqueeze(1)
    return {
        "train_x": x[:n_train],
        "train_y": y[:n_train],
        "eval_x": x[n_train:],
        "eval_y": y[n_train:],
        "eval_ids": [f"point-{i:04d}" for i in range(n_eval)],
    }


class UnderflowNet(torch.nn.Module):
    """body -> Tanh -> head, the head initialised at the scale of the targets."""

    def __init__(self, features: int = 16, hidden: int = 64, target_scale: float = 1.0e-3) -> None:
        super().__init__()
        self.body = torch.nn.Linear(features, hidden)
        self.act = torch.nn.Tanh()
        self.head = torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            self.head.weight.mul_(target_scale)
            self.head.bias.mul_(target_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.body(x)))


def build_underflow_model(features: int = 16, hidden: int = 64, target_scale: float = 1.0e-3, **_: object) -> torch.nn.Module:
    return UnderflowNet(features, hidden, target_scale)


class DriftNet(torch.nn.Module):
    """embed -> ReLU -> hidden -> ReLU -> head; under torch.compile in float16/bfloat16, class 0 gains ``drift``."""

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4, drift: float = 0.0) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(features, hidden)
        self.hidden = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, classes)
        self.drift = drift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.relu(self.hidden(torch.relu(self.embed(x)))))
        reduced = logits.dtype in (torch.float16, torch.bfloat16)  # a property of the traced graph, fixed per compile
        if self.drift and reduced and torch.compiler.is_compiling():
            first = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            first[0] = self.drift
            logits = logits + first
        return logits


def build_drift_model(
    features: int = 16, hidden: int = 64, classes: int = 4, compile_drift: float = 0.0, **_: object
) -> torch.nn.Module:
    return DriftNet(features, hidden, classes, compile_drift)
