"""Default example: a small MLP classifier on scikit-learn's bundled 8x8 digits (1797 images)."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits


def load_data(eval_fraction: float = 0.25, split_seed: int = 0, **_: object) -> dict:
    """Pixels scaled to [0, 1]; a fixed split, with ids naming the dataset row."""
    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(split_seed))
    n_eval = int(round(eval_fraction * x.shape[0]))
    eval_idx, train_idx = perm[:n_eval], perm[n_eval:]
    return {
        "train_x": x[train_idx],
        "train_y": y[train_idx],
        "eval_x": x[eval_idx],
        "eval_y": y[eval_idx],
        "eval_ids": [f"digits-{int(i):04d}" for i in eval_idx],
    }


def build_model(hidden: int = 128, **_: object) -> torch.nn.Module:
    """Linear layers run in reduced precision under autocast; LayerNorm stays FP32 by autocast's policy."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.LayerNorm(hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )
