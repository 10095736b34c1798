"""The fixed input set: ordinary samples, edge cases and decision-boundary cases, each with a stable id.

Ids say which kind a case is: ``ordinary/<data id>``, ``edge/<what>`` and ``boundary/<a>~<b>``.
Only ordinary cases carry a target; quality is measured on them, decisions are compared on all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline.artifacts import read_tensors, write_tensors
from pipeline.config import PrepareConfig
from pipeline.errors import UserError
from pipeline.task import TaskData


@dataclass
class Cases:
    ids: list[str]
    x: torch.Tensor
    y: torch.Tensor
    has_target: torch.Tensor

    @property
    def kinds(self) -> list[str]:
        return [i.split("/", 1)[0] for i in self.ids]

    def targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices of cases with a target, and those targets."""
        idx = torch.nonzero(self.has_target).flatten()
        return idx, self.y[idx]

    def __add__(self, other: "Cases") -> "Cases":
        return Cases(
            ids=self.ids + other.ids,
            x=torch.cat([self.x, other.x]),
            y=torch.cat([self.y, other.y]),
            has_target=torch.cat([self.has_target, other.has_target]),
        )


def save(path: str | Path, cases: Cases) -> str:
    tensors = {"x": cases.x.contiguous(), "y": cases.y.contiguous(), "has_target": cases.has_target.contiguous()}
    return write_tensors(path, tensors, {"ids": cases.ids})


def load(path: str | Path, expected_sha256: str | None = None, produced_by: str = "prepare") -> Cases:
    tensors, meta = read_tensors(path, expected_sha256, produced_by)
    ids = meta.get("ids")
    if not ids:
        raise UserError(f"{path} holds an empty fixed set; give the data function at least one eval sample")
    return Cases(ids=ids, x=tensors["x"], y=tensors["y"], has_target=tensors["has_target"])


def build(data: TaskData, cfg: PrepareConfig) -> Cases:
    """Ordinary cases in data order, then edge cases derived from them and from the training range."""
    n = min(cfg.ordinary_cases, data.eval_x.shape[0])
    ordinary = Cases(
        ids=[f"ordinary/{i}" for i in data.eval_ids[:n]],
        x=data.eval_x[:n].clone(),
        y=data.eval_y[:n].clone(),
        has_target=torch.ones(n, dtype=torch.bool),
    )
    return ordinary + edge_cases(ordinary, data.train_x, cfg, data.eval_y)


def edge_cases(ordinary: Cases, train_x: torch.Tensor, cfg: PrepareConfig, like_y: torch.Tensor) -> Cases:
    """Zeros, constant inputs at the training minimum and maximum, and ordinary samples scaled to extreme magnitudes."""
    shape = ordinary.x.shape[1:]
    items: list[tuple[str, torch.Tensor]] = [
        ("edge/zeros", torch.zeros(shape)),
        ("edge/constant-min", torch.full(shape, float(train_x.min()))),
        ("edge/constant-max", torch.full(shape, float(train_x.max()))),
    ]
    for scale in cfg.edge_scales:
        for i in range(min(cfg.edge_samples, len(ordinary.ids))):
            source = ordinary.ids[i].split("/", 1)[1]
            items.append((f"edge/scale-{scale:g}/{source}", ordinary.x[i] * scale))
    x = torch.stack([t for _, t in items]).float()
    y = torch.zeros((len(items),) + tuple(like_y.shape[1:]), dtype=like_y.dtype)
    return Cases(ids=[i for i, _ in items], x=x, y=y, has_target=torch.zeros(len(items), dtype=torch.bool))


def boundary_cases(
    score: Callable[[torch.Tensor], torch.Tensor],
    ordinary: Cases,
    count: int,
    epsilon: float,
    like_y: torch.Tensor,
    max_iter: int = 60,
) -> Cases:
    """Bisect between pairs of ordinary inputs the reference classifies differently, until the
    reference's top-2 margin is below ``epsilon`` (or the budget ends): cases a hair from the boundary.
    """
    scores = score(ordinary.x)
    labels = scores.argmax(dim=1)
    ids, xs = [], []
    for i in range(len(ordinary.ids)):
        if len(ids) >= count:
            break
        j = next((j for j in range(i + 1, len(ordinary.ids)) if labels[j] != labels[i]), None)
        if j is None:
            continue
        a, b, la = ordinary.x[i].double(), ordinary.x[j].double(), labels[i]
        lo, hi = 0.0, 1.0
        best, best_margin = None, float("inf")
        for _ in range(max_iter):
            mid = (lo + hi) / 2
            x = ((1 - mid) * a + mid * b).float()
            s = score(x.unsqueeze(0))[0]
            top2 = s.topk(2).values
            margin = float(top2[0] - top2[1])
            if margin < best_margin:
                best, best_margin = x, margin
            if best_margin < epsilon:
                break
            if s.argmax() == la:
                lo = mid
            else:
                hi = mid
        ids.append(f"boundary/{ordinary.ids[i].split('/', 1)[1]}~{ordinary.ids[j].split('/', 1)[1]}")
        xs.append(best)
    n = len(ids)
    x = torch.stack(xs) if xs else torch.zeros((0,) + tuple(ordinary.x.shape[1:]))
    y = torch.zeros((n,) + tuple(like_y.shape[1:]), dtype=like_y.dtype)
    return Cases(ids=ids, x=x, y=y, has_target=torch.zeros(n, dtype=torch.bool))
