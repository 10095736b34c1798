"""The fixed input set: ordinary samples, edge cases and decision-boundary cases, each with a stable id.

Ids say which kind a case is: ``ordinary/<data id>``, ``edge/<what>``, ``boundary/<a>~<b>`` (constructed
by bisection between two real inputs) or ``selected/<data id>`` (a REAL sample selected for its small
reference margin: judged as a real sample, its flips are never excused as those of a constructed case).
Only ordinary cases carry a target; quality is measured on them, decisions are compared on all.

Inputs are kept as the data function gives them (a tensor or a dict of tensors, any dtype): scaled and
constant edge cases change floating tensors only, and bisection needs floating inputs; for any other
input, boundary cases are selected among the real samples. Users add named edge cases of their own
with ``edge_x`` / ``edge_ids`` from the data function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pipeline import task
from pipeline.artifacts.record import Record
from pipeline.files import read_tensors, write_tensors
from pipeline.config import PrepareConfig
from pipeline.errors import UserError
from pipeline.task import Inputs, TaskData


@dataclass
class Cases:
    ids: list[str]
    x: Inputs
    y: torch.Tensor
    has_target: torch.Tensor
    meta: dict = field(default_factory=dict)
    """What was asked and what was available (``ordinary_requested``, ``ordinary_available``), saved with the cases."""

    @property
    def kinds(self) -> list[str]:
        return [i.split("/", 1)[0] for i in self.ids]

    def targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices of cases with a target, and those targets."""
        idx = torch.nonzero(self.has_target).flatten()
        return idx, self.y[idx]

    def select(self, idx) -> "Cases":
        return Cases(
            ids=[self.ids[i] for i in torch.as_tensor(idx).tolist()],
            x=self.x[idx],
            y=self.y[idx],
            has_target=self.has_target[idx],
        )

    def __add__(self, other: "Cases") -> "Cases":
        if not other.ids:
            return self
        return Cases(
            ids=self.ids + other.ids,
            x=task.cat([self.x, other.x]),
            y=torch.cat([self.y, other.y]),
            has_target=torch.cat([self.has_target, other.has_target]),
            meta=self.meta,
        )


def aligned(fixed: Cases, shifted: bool) -> Cases:
    """``fixed`` with its targets where the model's own loss reads them. ``shifted`` (``probe.check`` found it): per
    token, as a causal LM reads its labels, position t is scored against the token at t + 1 and the last position
    against none (-100); Hugging Face's ``...ForCausalLM`` shifts the labels it is given inside its loss, so its
    logits at t are judged against the next token, as it was trained. Else ``fixed`` itself."""
    if not shifted:
        return fixed
    y = torch.full_like(fixed.y, task.IGNORE_INDEX)
    y[:, :-1] = fixed.y[:, 1:]
    return Cases(ids=fixed.ids, x=fixed.x, y=y, has_target=fixed.has_target,
                 meta={**fixed.meta, "targets": "next token: the model's own loss shifts its labels by one position"})


@dataclass(frozen=True)
class Header(Record):
    """A cases file's metadata: the ids in row order, and ``Cases.meta`` where it is not empty."""

    ABSENT = ("cases",)

    ids: list[str]
    cases: dict | None = None


def save(path: str | Path, cases: Cases) -> str:
    tensors = {**task.flatten(cases.x, "x"), "y": cases.y.contiguous(), "has_target": cases.has_target.contiguous()}
    return write_tensors(path, tensors, Header(ids=cases.ids, cases=cases.meta or None).as_dict())


def load(path: str | Path, expected_sha256: str | None = None, produced_by: str = "prepare") -> Cases:
    """Raises: UserError: the file is missing, damaged, of another version, or holds no case."""
    tensors, meta = read_tensors(path, expected_sha256, produced_by)
    try:
        header = Header.from_dict(meta)
    except ValueError as exc:
        raise UserError(f"{path} is not a cases file of this version ({exc}); run `dvc repro {produced_by}`") from None
    if not header.ids:
        raise UserError(f"{path} holds an empty fixed set; give the data function at least one eval sample")
    y, has_target = tensors["y"], tensors["has_target"]  # the file's tensor names (``save``)
    return Cases(ids=header.ids, x=task.unflatten(tensors, "x"), y=y, has_target=has_target, meta=header.cases or {})


def build(data: TaskData, cfg: PrepareConfig) -> Cases:
    """Ordinary cases in data order, then edge cases derived from them and from the training range,
    then the user's named edge cases."""
    available = task.rows(data.eval_x)
    n = min(cfg.ordinary_cases, available)
    ordinary = Cases(
        ids=[f"ordinary/{i}" for i in data.eval_ids[:n]],
        x=data.eval_x[torch.arange(n)],  # a copy, not a view of the whole eval set
        y=data.eval_y[:n].clone(),
        has_target=torch.ones(n, dtype=torch.bool),
        meta={"ordinary_requested": cfg.ordinary_cases, "ordinary_available": available, "ordinary_cases": n},
    )
    in_memory = data.train.x if isinstance(data.train, task.TensorSource) else ordinary.x
    fixed = ordinary + edge_cases(ordinary, in_memory, cfg, data.eval_y)
    if data.edge_x is not None:
        k = task.rows(data.edge_x)
        fixed = fixed + Cases(
            ids=[f"edge/user/{i}" for i in data.edge_ids],
            x=data.edge_x,
            y=torch.zeros((k,) + tuple(data.eval_y.shape[1:]), dtype=data.eval_y.dtype),
            has_target=torch.zeros(k, dtype=torch.bool),
        )
    return fixed


def _constant(template: Inputs, ranges: Inputs, pick: str) -> Inputs:
    """``template`` with every floating tensor replaced by the minimum (or maximum, or zero) of its name in ``ranges``."""

    def value(t: torch.Tensor, name: str) -> torch.Tensor:
        if pick == "zeros":
            return torch.zeros_like(t)
        src = ranges if torch.is_tensor(ranges) else ranges[name]
        return torch.full_like(t, float(src.min() if pick == "min" else src.max()))

    if torch.is_tensor(template):
        return value(template, "")
    return task.Batch({k: value(v, k) if v.is_floating_point() else v for k, v in template.items()})


def edge_cases(ordinary: Cases, train_x: Inputs, cfg: PrepareConfig, like_y: torch.Tensor) -> Cases:
    """Zeros, constant inputs at the training minimum and maximum, and ordinary samples scaled to extreme
    magnitudes; built on floating input tensors only (ids and masks are kept from the first sample)."""
    floating = {k for k, t in task.tensors_of(ordinary.x).items() if t.is_floating_point()}
    if not floating or not ordinary.ids:
        return Cases(ids=[], x=ordinary.x[:0], y=like_y[:0], has_target=torch.zeros(0, dtype=torch.bool))
    template = ordinary.x[0]
    items: list[tuple[str, Inputs]] = [
        ("edge/zeros", _constant(template, train_x, "zeros")),
        ("edge/constant-min", _constant(template, train_x, "min")),
        ("edge/constant-max", _constant(template, train_x, "max")),
    ]
    for scale in cfg.edge_scales:
        for i in range(min(cfg.edge_samples, len(ordinary.ids))):
            source = ordinary.ids[i].split("/", 1)[1]
            items.append((f"edge/scale-{scale:g}/{source}", task.map_floating(ordinary.x[i], lambda t: t * scale)))
    x = task.stack([t for _, t in items])
    y = torch.zeros((len(items),) + tuple(like_y.shape[1:]), dtype=like_y.dtype)
    return Cases(ids=[i for i, _ in items], x=x, y=y, has_target=torch.zeros(len(items), dtype=torch.bool))


def margins(scores: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Top-2 margin per case; per token [N, T, C], the smallest over the tokens ``kept`` marks [N, T] (all when None:
    a padded or ignored position is no decision anyone reads; a case with none kept has an infinite margin)."""
    top2 = scores.topk(2, dim=-1).values.double()  # the same two values as in float64: no float64 copy of the scores
    m = top2[..., 0] - top2[..., 1]
    if m.ndim > 1 and kept is not None and tuple(kept.shape) == tuple(m.shape):
        m = m.masked_fill(~kept, torch.inf)
    return m.reshape(m.shape[0], -1).min(dim=1).values if m.ndim > 1 else m


def boundary_cases(
    score: Callable[[Inputs], torch.Tensor],
    ordinary: Cases,
    count: int,
    epsilon: float,
    like_y: torch.Tensor,
    max_iter: int = 60,
    method: str = "auto",
) -> Cases:
    """Cases a hair from the reference's decision boundary.

    ``bisect``: between pairs of ordinary inputs the reference classifies differently, until the top-2
    margin is below ``epsilon`` (or the budget ends); floating inputs and [N, C] scores only.
    ``select``: the ``count`` ordinary samples with the smallest reference top-2 margin, as they are.
    ``auto``: bisect where possible, select otherwise.

    Raises:
        UserError: ``bisect`` asked for inputs that cannot be interpolated.
    """
    kept = task.masked_targets(ordinary.y, task.token_mask_of(ordinary.x)) != task.IGNORE_INDEX  # per token: [N, T]
    case_margins, scores = _scored(score, ordinary.x, kept)
    can_bisect = task.is_floating(ordinary.x) and scores is not None
    if method == "bisect" and not can_bisect:
        raise UserError(
            "reference.boundary_method is bisect but the inputs are not all floating (or scores are per token); "
            "use auto or select, which picks real samples nearest the boundary"
        )
    if method == "select" or not can_bisect:
        return _select(case_margins, ordinary, count, like_y)
    built = _bisect(score, scores, ordinary, count, epsilon, like_y, max_iter)
    if method == "auto" and len(built.ids) < count:  # too few pairs the reference tells apart: add real samples
        built = built + _select(case_margins, ordinary, count - len(built.ids), like_y)
    return built


SCORED_ELEMENTS = 4_000_000
"""The most scores ``boundary_cases`` holds at once (16 MB of float32): per-token scores of an LM's fixed set,
[N, T, V], are margins of a slice of rows at a time, never whole in memory."""


def _scored(
    score: Callable[[Inputs], torch.Tensor], x: Inputs, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each case's margin (``margins`` over the kept ``positions``), and the scores themselves where they are per case
    [N, C] (bisection needs them); ``score`` called on slices of rows of at most ``SCORED_ELEMENTS`` scores."""
    n = task.rows(x)
    if n == 0:
        return torch.zeros(0, dtype=torch.float64), score(x)
    first = score(x[:1])
    step = task.rows_within(SCORED_ELEMENTS, first[0].numel())
    found, kept = [], []
    for start in range(0, n, step):
        s = score(x[start : start + step])
        found.append(margins(s, positions[start : start + step]))
        if s.ndim == 2:
            kept.append(s)
    return torch.cat(found), (torch.cat(kept) if kept else None)


def _select(case_margins: torch.Tensor, ordinary: Cases, count: int, like_y: torch.Tensor) -> Cases:
    m = case_margins
    order = sorted(range(len(ordinary.ids)), key=lambda i: (float(m[i]), i))[:count]
    idx = torch.tensor(order, dtype=torch.long)
    n = len(order)
    return Cases(  # the sample's own targets: per token, their ignored positions stay ignored (quality counts it once)
        ids=[f"selected/{ordinary.ids[i].split('/', 1)[1]}" for i in order],
        x=ordinary.x[idx],
        y=ordinary.y[idx].to(like_y.dtype) if n else torch.zeros((0,) + tuple(like_y.shape[1:]), dtype=like_y.dtype),
        has_target=torch.zeros(n, dtype=torch.bool),
    )


def _lerp(a: Inputs, b: Inputs, t: float) -> Inputs:
    if torch.is_tensor(a):
        return ((1 - t) * a.double() + t * b.double()).to(a.dtype)
    return task.Batch({k: ((1 - t) * a[k].double() + t * b[k].double()).to(a[k].dtype) for k in a})


def _bisect(score, scores, ordinary: Cases, count: int, epsilon: float, like_y: torch.Tensor, max_iter: int) -> Cases:
    labels = scores.argmax(dim=1)
    ids, xs = [], []
    for i in range(len(ordinary.ids)):
        if len(ids) >= count:
            break
        j = next((j for j in range(i + 1, len(ordinary.ids)) if labels[j] != labels[i]), None)
        if j is None:
            continue
        a, b, la = ordinary.x[i], ordinary.x[j], labels[i]
        lo, hi = 0.0, 1.0
        best, best_margin = None, float("inf")
        for _ in range(max_iter):
            mid = (lo + hi) / 2
            x = _lerp(a, b, mid)
            s = score(task.stack([x]))[0]
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
    x = task.stack(xs) if xs else ordinary.x[:0]
    y = torch.zeros((n,) + tuple(like_y.shape[1:]), dtype=like_y.dtype)
    return Cases(ids=ids, x=x, y=y, has_target=torch.zeros(n, dtype=torch.bool))
