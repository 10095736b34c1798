"""Built-in language-model example: a small causal transformer predicting the next token of synthetic text.

Outputs are per-token scores [N, T, vocab] against targets [N, T] (the next token; -100 where a sequence
is padded, ignored as Hugging Face does), so compare reports per-token flips, token accuracy, perplexity,
KL(reference || trial), top-1 agreement and top-k overlap. Needs nothing but torch; the text is generated
from ``data_seed``, never downloaded.

The source: a seeded Markov chain (``order`` 1 or 2) over ``vocab`` tokens whose transitions are
concentrated on a few successors per context (``branching``), so a small model learns it in a few hundred
updates and its logits have real structure (confident tokens, near-ties), like a language model's.

    task:
      kind: classification
      model: pipeline.examples.lm:build_model
      data: pipeline.examples.lm:load_data
      options: {vocab: 96, seq_len: 32, d_model: 64, layers: 2}
"""

from __future__ import annotations

import math

import torch

from pipeline.errors import UserError
from pipeline.examples.transformer import Block

IGNORE_INDEX = -100
PAD = 0
"""Token id of padding (inputs after a sequence's end); its targets are -100."""


def _chain(vocab: int, branching: int, order: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The transitions from each of the ``vocab ** order`` contexts: ``branching`` successors (never PAD) and their
    logits, both [contexts, branching]. Kept sparse: a dense [contexts, vocab] table would be 4 GB at vocab 32,000."""
    contexts = vocab**order
    succ = torch.randint(1, vocab, (contexts, branching), generator=gen)
    return succ, torch.randn(contexts, branching, generator=gen) * 1.5


def _next_probs(chain: tuple[torch.Tensor, torch.Tensor], context: torch.Tensor, vocab: int) -> torch.Tensor:
    """The next-token probabilities [len(context), vocab] of each sequence's context: the dense table's rows, value
    for value, built for the contexts drawn only."""
    succ, weights = chain
    logits = torch.full((len(context), vocab), -math.inf)
    logits.scatter_(1, succ[context], weights[context])
    return torch.softmax(logits, dim=1)


def load_data(
    n_train: int = 1024,
    n_eval: int = 64,
    seq_len: int = 32,
    vocab: int = 96,
    branching: int = 4,
    order: int = 1,
    max_padding: int = 6,
    data_seed: int = 0,
    **_: object,
) -> dict:
    """Deterministic token sequences from ``data_seed``: inputs ``x`` [N, seq_len] (int64 ids) and next-token
    targets ``y`` [N, seq_len] (-100 after each sequence's end: 0 to ``max_padding`` padded positions).

    Raises:
        UserError: sizes that cannot make sequences.
    """
    if vocab < 3 or not 1 <= branching < vocab or order not in (1, 2):
        raise UserError(f"task.options: need vocab >= 3, 1 <= branching < vocab and order 1 or 2; got vocab={vocab}, "
                        f"branching={branching}, order={order}")
    if seq_len < 2 or not 0 <= max_padding < seq_len:
        raise UserError(
            f"task.options: need seq_len >= 2 and 0 <= max_padding < seq_len; got seq_len={seq_len}, max_padding={max_padding}"
        )
    gen = torch.Generator().manual_seed(data_seed)
    chain = _chain(vocab, branching, order, gen)
    n = n_train + n_eval
    tokens = torch.empty(n, seq_len + 1, dtype=torch.long)
    tokens[:, :order] = torch.randint(1, vocab, (n, order), generator=gen)
    for t in range(order, seq_len + 1):  # vectorised over sequences: one multinomial draw per position
        context = tokens[:, t - 1] if order == 1 else tokens[:, t - 2] * vocab + tokens[:, t - 1]
        tokens[:, t] = torch.multinomial(_next_probs(chain, context, vocab), 1, generator=gen).squeeze(1)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    pads = torch.randint(0, max_padding + 1, (n,), generator=gen)
    padded = torch.arange(seq_len).unsqueeze(0) >= (seq_len - pads).unsqueeze(1)
    x[padded] = PAD
    y[padded] = IGNORE_INDEX
    return {
        "train_x": x[:n_train],
        "train_y": y[:n_train],
        "eval_x": x[n_train:],
        "eval_y": y[n_train:],
        "eval_ids": [f"text-{i:05d}" for i in range(n_eval)],
    }


class CausalLM(torch.nn.Module):
    """Token embedding, learned positions, causal blocks, final norm, LM head: logits [N, T, vocab]."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, heads: int, layers: int, mlp_ratio: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.randn(seq_len, d_model) / math.sqrt(d_model))
        self.blocks = torch.nn.ModuleList(Block(d_model, heads, mlp_ratio, causal=True) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model(
    seq_len: int = 32,
    vocab: int = 96,
    d_model: int = 64,
    heads: int = 4,
    layers: int = 2,
    mlp_ratio: int = 4,
    **_: object,
) -> torch.nn.Module:
    """The language model for sequences made by ``load_data`` with the same options.

    Raises:
        UserError: ``d_model`` is not a multiple of ``heads``.
    """
    if d_model % heads:
        raise UserError(f"task.options: d_model ({d_model}) must be a multiple of heads ({heads})")
    return CausalLM(vocab, seq_len, d_model, heads, layers, mlp_ratio)
