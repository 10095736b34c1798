"""Default example: a small MLP classifier on scikit-learn's bundled 8x8 digits (1797 images)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch


def digits_table() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as ``sklearn.datasets.load_digits`` reads them: pixels [1797, 64] (float64, 0..16), labels.

    The file is read from the installed scikit-learn without importing it: its import costs about a second
    in every stage that builds this model or its data.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the digits example reads scikit-learn's bundled data: pip install scikit-learn")
    table = np.loadtxt(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def load_data(eval_fraction: float = 0.25, split_seed: int = 0, **_: object) -> dict:
    """Pixels scaled to [0, 1]; a fixed split, with ids naming the dataset row."""
    pixels, labels = digits_table()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
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
