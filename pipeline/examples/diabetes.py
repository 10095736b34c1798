"""Regression example: scikit-learn's bundled diabetes data (442 patients, 10 features)."""

from __future__ import annotations

import torch


def load_data(eval_fraction: float = 0.25, split_seed: int = 0, **_: object) -> dict:
    """Features as shipped (already centred and scaled); the target standardised with training statistics."""
    from sklearn.datasets import load_diabetes  # here, not at the top: a stage that only builds the model skips its 1 s import

    bunch = load_diabetes()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.float32)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(split_seed))
    n_eval = int(round(eval_fraction * x.shape[0]))
    eval_idx, train_idx = perm[:n_eval], perm[n_eval:]
    mean, std = y[train_idx].mean(), y[train_idx].std()
    y = (y - mean) / std
    return {
        "train_x": x[train_idx],
        "train_y": y[train_idx].unsqueeze(1),
        "eval_x": x[eval_idx],
        "eval_y": y[eval_idx].unsqueeze(1),
        "eval_ids": [f"diabetes-{int(i):03d}" for i in eval_idx],
    }


def build_model(hidden: int = 64, **_: object) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(10, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )
