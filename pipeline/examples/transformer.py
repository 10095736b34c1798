"""Built-in transformer example: a small encoder classifier over synthetic, seeded token sequences.

It needs nothing but torch (no scikit-learn, nothing downloaded), so it runs in a bare PyTorch image, and
``task.options`` size it: the defaults finish a CPU pipeline in seconds, while ``d_model`` 1024, ``layers``
8 and ``seq_len`` 256 (see scripts/gpu_check.py) make a GPU step compute-bound, which is where AMP gains.

The task: each sequence is filler tokens plus a few "marker" tokens, one marker per class; the label is the
marker planted most often (strictly: no ties). Tokens enter the model as integer ids (int64) through an
``nn.Embedding``, as in any language model: the pipeline keeps their dtype, builds no scaled edge cases from
them (ids cannot be scaled) and selects boundary cases among the real sequences.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.errors import UserError


def load_data(
    n_train: int = 2048,
    n_eval: int = 512,
    seq_len: int = 32,
    vocab: int = 64,
    classes: int = 4,
    data_seed: int = 0,
    **_: object,
) -> dict:
    """Deterministic sequences from ``data_seed``: the same options always give the same tensors.

    Args:
        n_train: training sequences.
        n_eval: evaluation sequences (ids ``seq-NNNNN``).
        seq_len: tokens per sequence.
        vocab: token kinds; the first ``classes`` are the markers.
        classes: number of classes (one marker token each).
        data_seed: seeds the sequences.
    """
    if not 2 <= classes < vocab:
        raise UserError(f"task.options: classes must be in [2, vocab); got classes={classes}, vocab={vocab}")
    if seq_len < 2 * classes:
        raise UserError(f"task.options: seq_len must be at least 2 * classes ({2 * classes}); got {seq_len}")
    gen = torch.Generator().manual_seed(data_seed)
    n = n_train + n_eval
    tokens = torch.randint(classes, vocab, (n, seq_len), generator=gen)  # filler: never a marker
    labels = torch.randint(0, classes, (n,), generator=gen)
    # The winning marker appears `top` times, every other marker fewer times, so the label is unambiguous.
    top = max(2, seq_len // (2 * classes))
    counts = torch.randint(0, top // 2 + 1, (n, classes), generator=gen)
    counts[torch.arange(n), labels] = top
    for i in range(n):
        slots = torch.randperm(seq_len, generator=gen)
        start = 0
        for marker in range(classes):
            k = int(counts[i, marker])
            tokens[i, slots[start : start + k]] = marker
            start += k
    x = tokens
    return {
        "train_x": x[:n_train],
        "train_y": labels[:n_train],
        "eval_x": x[n_train:],
        "eval_y": labels[n_train:],
        "eval_ids": [f"seq-{i:05d}" for i in range(n_eval)],
    }


class Block(torch.nn.Module):
    """Pre-norm transformer block: self-attention then MLP, each on a residual branch; ``causal`` makes it a
    decoder block (each position attends to itself and earlier ones), as the language-model example uses."""

    def __init__(self, d_model: int, heads: int, mlp_ratio: int, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.norm2 = torch.nn.LayerNorm(d_model)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d_model, mlp_ratio * d_model),
            torch.nn.GELU(),
            torch.nn.Linear(mlp_ratio * d_model, d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # scaled_dot_product_attention picks a fused kernel (flash / memory-efficient) where the device has one.
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TransformerClassifier(torch.nn.Module):
    """Token embedding, learned positions, encoder blocks, final norm, mean pooling, linear head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, heads: int, layers: int, mlp_ratio: int, classes: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.randn(seq_len, d_model) / math.sqrt(d_model))
        self.blocks = torch.nn.ModuleList(Block(d_model, heads, mlp_ratio) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))


def build_model(
    seq_len: int = 32,
    vocab: int = 64,
    classes: int = 4,
    d_model: int = 64,
    heads: int = 4,
    layers: int = 2,
    mlp_ratio: int = 4,
    **_: object,
) -> torch.nn.Module:
    """The classifier for sequences made by ``load_data`` with the same options.

    Raises:
        UserError: ``d_model`` is not a multiple of ``heads``.
    """
    if d_model % heads:
        raise UserError(f"task.options: d_model ({d_model}) must be a multiple of heads ({heads})")
    return TransformerClassifier(vocab, seq_len, d_model, heads, layers, mlp_ratio, classes)
