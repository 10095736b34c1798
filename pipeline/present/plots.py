"""The figures a reviewer opens, as PNG bytes, and the flat curve rows that `dvc plots` reads.

Pure: step records and output arrays in, bytes or rows out; nothing is read or written here. The PNGs
are DVC outputs, so they must be identical bytes on every rerun on the same machine: figures are built
on a private Agg canvas (no pyplot, no global backend switch), under matplotlib's default style (a
user's matplotlibrc cannot change the bytes), and saved without the "Software" metadata (the only
field that would otherwise carry a version string). PNG from Agg has no timestamp.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from pipeline.artifacts.steps import Steps
    from pipeline.config import AcceptanceConfig

# One size for every figure: readable in the MLflow artifact viewer and small inside the HTML report.
_SIZE = (8.0, 4.0)
_DPI = 100
_FP32, _AMP, _BAD = "#1f77b4", "#ff7f0e", "#d62728"


def _styled(draw: Callable[..., bytes]) -> Callable[..., bytes]:
    """Draw under matplotlib's default style: artists take their sizes and colours when created, so the
    whole drawing, not only the save, must ignore the user's matplotlibrc."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs) -> bytes:
        import matplotlib.style

        with matplotlib.style.context("default"):
            return draw(*args, **kwargs)

    return wrapper


def curve_rows(
    ref_steps: Steps, trial_steps: Steps, dtype: str = "", band: AcceptanceConfig | None = None,
    noise_steps: Steps | None = None,
) -> dict[str, list[dict]]:
    """Per-step rows for `dvc plots`, in long form (one value per row, named by ``series``), one list per family.

    ``loss``: the FP32 and AMP losses (``panel`` "loss"), then AMP's |gap| to FP32, the band the rule allows
    (``band``: the rule, whose ``loss_band`` is atol + rtol*|FP32 loss|) and, when given, the FP32 noise floor
    (|replicate - FP32|) (``panel`` "gap"). ``scale``: the loss scale and the skipped updates. Every row
    carries ``dtype``: the plot templates title, colour and facet by these fields, so one template serves
    every dtype and `dvc plots diff` tells revisions apart by DVC's own ``rev``.
    """
    ref_loss = {s.step: s.loss for s in ref_steps}
    amp = f"AMP {dtype}".strip()
    loss: list[dict] = []
    for s in trial_steps:
        step = s.step
        fp32 = ref_loss.get(step, math.nan)
        loss.append({"step": step, "dtype": dtype, "panel": "loss", "series": "FP32 reference", "value": fp32})
        loss.append({"step": step, "dtype": dtype, "panel": "loss", "series": amp, "value": s.loss})
        loss.append({"step": step, "dtype": dtype, "panel": "gap", "series": f"|{amp} - FP32|", "value": abs(s.loss - fp32)})
        if band is not None and band.has_loss_band:
            loss.append({
                "step": step, "dtype": dtype, "panel": "gap", "series": "band allowed by the rule", "value": band.loss_band(fp32),
            })
    for s in noise_steps or []:
        step = s.step
        if step in ref_loss:
            loss.append({
                "step": step, "dtype": dtype, "panel": "gap", "series": "FP32 noise floor",
                "value": abs(s.loss - ref_loss[step]),
            })
    enabled = any(s.scale != 1.0 for s in trial_steps) or dtype == "float16"
    label = "loss scale" if enabled else "no GradScaler: scale fixed at 1"
    scale = [
        {"step": s.step, "dtype": dtype, "series": label, "scale": s.scale, "skipped": int(s.skipped)}
        for s in trial_steps
    ]
    return {"loss": [_finite_row(r) for r in loss], "scale": [_finite_row(r) for r in scale]}


def _finite_row(row: dict) -> dict:
    """JSON for DVC: a non-finite value becomes null (vega leaves a gap there)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


@_styled
def loss_curves(ref_steps: Steps, trial_steps: Steps, dtype: str, band: AcceptanceConfig | None = None,
                noise_steps: Steps | None = None) -> bytes:
    """Training loss per step, FP32 reference against the AMP trial (top), and AMP's |gap| against the band
    the rule allows, ``atol + rtol*|FP32 loss|`` (bottom), with the FP32 noise floor when one was measured."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(_SIZE[0], _SIZE[1] * 1.5), dpi=_DPI, layout="constrained")
    ax, gap_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    rs, rl = _series(ref_steps, "loss")
    ts, tl = _series(trial_steps, "loss")
    ax.plot(rs, rl, color=_FP32, label="FP32 reference", linewidth=1.5)
    ax.plot(ts, tl, color=_AMP, label=f"AMP {dtype}", linewidth=1.2, linestyle="--")
    bad = [s for s, v in zip(ts, tl) if not math.isfinite(v)]
    for s in bad:
        ax.axvline(s, color=_BAD, alpha=0.3, linewidth=1)
    if bad:
        ax.plot([], [], color=_BAD, alpha=0.5, label=f"non-finite AMP loss ({len(bad)} steps, first {bad[0]})")
    ax.set(ylabel="training loss", title=f"Training loss: FP32 vs AMP {dtype}")
    ax.legend(loc="upper right", fontsize="small")
    ref = dict(zip(rs, rl))
    shared = [(s, v) for s, v in zip(ts, tl) if s in ref]
    gaps = [abs(v - ref[s]) for s, v in shared]
    gap_ax.plot([s for s, _ in shared], gaps, color=_AMP, label=f"|AMP {dtype} - FP32|")
    if band is not None and band.has_loss_band:
        gap_ax.plot([s for s, _ in shared], [band.loss_band(ref[s]) for s, _ in shared], color=_BAD, linestyle=":",
                    label=f"band: {band.loss_atol or 0:g} + {band.loss_rtol or 0:g}*|FP32 loss|")
        outside = [(s, g) for (s, _), g in zip(shared, gaps) if math.isfinite(g) and g > band.loss_band(ref[s])]
        if outside:
            gap_ax.plot(
                [s for s, _ in outside], [g for _, g in outside], "x", color=_BAD,
                label=f"outside the band ({len(outside)} steps)",
            )
    if noise_steps:
        ns, nl = _series(noise_steps, "loss")
        gap_ax.plot([s for s in ns if s in ref], [abs(v - ref[s]) for s, v in zip(ns, nl) if s in ref], color=_FP32, linewidth=1,
                    label="FP32 noise floor (|replicate - FP32|)")
    if any(math.isfinite(g) and g > 0 for g in gaps):
        gap_ax.set_yscale("log")
    gap_ax.set(xlabel="step", ylabel="|loss gap|")
    _integer_steps(gap_ax)
    gap_ax.legend(loc="upper left", fontsize="small", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


@_styled
def loss_scale(trial_steps: Steps, dtype: str) -> bytes:
    """GradScaler loss scale per step (log scale), skipped updates marked with a red cross."""
    fig, ax = _figure()
    steps, scales = _series(trial_steps, "scale")
    ax.step(steps, scales, where="post", color=_AMP, label="loss scale")
    skipped = [(s.step, s.scale) for s in trial_steps if s.skipped]
    if skipped:
        ax.plot(
            [s for s, _ in skipped], [v for _, v in skipped], "x", color=_BAD, markersize=7,
            label=f"skipped update ({len(skipped)})",
        )
    else:
        ax.plot([], [], "x", color=_BAD, label="skipped update (none)")
    finite = [v for v in scales if math.isfinite(v) and v > 0]
    if finite:
        ax.set_yscale("log", base=2)  # the scaler halves and doubles: powers of two read best
    title = f"Loss scale per step: AMP {dtype}"
    if finite and max(finite) == min(finite) == 1.0:
        title = f"AMP {dtype}: no GradScaler (scale fixed at 1 by design, not a collapse)"
    ax.set(xlabel="step", ylabel="loss scale", title=title)
    _integer_steps(ax)
    ax.legend(loc="lower left")
    return _png(fig)


MAX_POINTS = 20000
"""Most elements drawn per output in the envelope plot: every one outside the envelope or in a flipped case
(up to the cap), then an even stride of the others. Counts in the legend are always exact."""


@_styled
def error_envelope(
    reference: Mapping[str, np.ndarray],
    trial: Mapping[str, np.ndarray],
    tolerances: Mapping[str, tuple[float, float]],
    dtype: str,
    flipped: np.ndarray | None = None,
    note: str = "",
) -> bytes:
    """Per output element: |AMP - FP32| against |FP32|, on log axes, under the envelope ``atol + rtol*|ref|``
    that the rule allows. Elements above it fail; elements of flipped cases (``flipped``: one bool per row)
    are ringed. Exact matches (error 0) cannot sit on a log axis: counted in the legend."""
    fig, ax = _figure()
    xmin, xmax, shown = math.inf, -math.inf, False
    for i, name in enumerate(sorted(reference)):
        r, t = np.asarray(reference[name], dtype=np.float64), np.asarray(trial[name], dtype=np.float64)
        rows = r.shape[0] if r.ndim else 1
        per_row = max(1, r.size // max(rows, 1))
        r, t = r.reshape(-1), t.reshape(-1)
        atol, rtol = tolerances.get(name, (0.0, 0.0))
        err, mag = np.abs(t - r), np.abs(r)
        ok = np.isfinite(err) & np.isfinite(mag)
        env = atol + rtol * mag
        out = ok & (err > env)
        ring = (
            np.repeat(np.asarray(flipped, dtype=bool), per_row)[: r.size] if flipped is not None and len(flipped) == rows
            else np.zeros(r.size, bool)
        )
        draw = ok & (err > 0) & (mag > 0)
        exact = int((ok & (err == 0)).sum())
        pick = _pick(draw, out | ring)
        colour = f"C{i % 10}"
        if pick.size:
            shown = True
            ax.scatter(mag[pick], err[pick], s=5, alpha=0.4, color=colour, linewidths=0,
                       label=f"'{name}': {int(ok.sum())} elements, {int(out.sum())} above the envelope, {exact} exact")
            xmin, xmax = min(xmin, float(mag[pick].min())), max(xmax, float(mag[pick].max()))
            bad = pick[out[pick]]
            if bad.size:
                ax.scatter(mag[bad], err[bad], s=7, color=_BAD, linewidths=0)
            rung = pick[ring[pick]]
            if rung.size:
                ax.scatter(mag[rung], err[rung], s=40, facecolors="none", edgecolors="black", linewidths=0.8,
                           label=f"'{name}': elements of the {int(np.asarray(flipped).sum())} flipped case(s)")
        if not ok.all():
            ax.plot([], [], " ", label=f"'{name}': {int((~ok).sum())} non-finite element(s) not drawn")
    if shown:
        xs = np.logspace(math.log10(xmin), math.log10(xmax), 64)
        for i, name in enumerate(sorted(reference)):
            atol, rtol = tolerances.get(name, (0.0, 0.0))
            if atol > 0 or rtol > 0:
                ax.plot(xs, atol + rtol * xs, color=_BAD if len(reference) == 1 else f"C{i % 10}", linestyle="--", linewidth=1.2,
                        label=f"envelope '{name}': {atol:g} + {rtol:g}*|ref|")
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "every element identical to the reference", ha="center", va="center", transform=ax.transAxes)
    title = f"Error against the tolerance envelope: AMP {dtype}" + (f"\n({note})" if note else "")
    ax.set(xlabel="|FP32 reference| per element", ylabel=f"|AMP {dtype} - FP32|", title=title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize="x-small", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


def _pick(draw: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Indices to draw: those in ``first`` (up to MAX_POINTS), then an even stride of the rest; sorted."""
    priority = np.flatnonzero(draw & first)[:MAX_POINTS]
    rest = np.flatnonzero(draw & ~first)
    room = MAX_POINTS - priority.size
    if rest.size > room:
        rest = rest[np.linspace(0, rest.size - 1, max(room, 0)).astype(np.int64)] if room > 0 else rest[:0]
    return np.sort(np.concatenate([priority, rest]))


@_styled
def error_histogram(
    reference: Mapping[str, np.ndarray],
    trial: Mapping[str, np.ndarray],
    tolerances: Mapping[str, float],
    dtype: str,
    note: str = "",
) -> bytes:
    """Histogram of |trial - reference| per element on log-spaced bins, with each output's atol marked.

    Exact matches (error 0) have no place on a log axis: their count goes in the legend instead.
    """
    fig, ax = _figure()
    errors = {}
    for name in sorted(reference):
        e = np.abs(_flat(trial[name]) - _flat(reference[name]))
        errors[name] = e[np.isfinite(e)]
    positive = np.concatenate([e[e > 0] for e in errors.values()] or [np.zeros(0)])
    if positive.size:
        lo = math.floor(math.log10(float(positive.min())))
        hi = math.ceil(math.log10(float(positive.max()))) + (1 if positive.min() == positive.max() else 0)
        bins = np.logspace(lo, hi, max(10, 8 * (hi - lo)) + 1)
        for name, e in errors.items():
            zeros = int((e == 0).sum())
            ax.hist(e[e > 0], bins=bins, alpha=0.6, label=f"{name}: {e.size} elements, {zeros} exact")
        ax.set_xscale("log")
    for name in sorted(tolerances):
        ax.axvline(tolerances[name], color=_BAD, linestyle=":", linewidth=1.2, label=f"atol {name} = {tolerances[name]:g}")
    if not positive.size:
        ax.text(0.5, 0.5, "every element identical to the reference", ha="center", va="center", transform=ax.transAxes)
    ax.set(
        xlabel="|AMP - FP32| per element", ylabel="elements",
        title=f"Absolute error, AMP {dtype} vs FP32" + (f"\n({note})" if note else ""),
    )
    ax.legend(loc="upper left", fontsize="x-small", bbox_to_anchor=(1.01, 1.0))  # beside the axes, never over the bars
    return _png(fig)


def _figure(square: bool = False):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.8, 4.8) if square else _SIZE, dpi=_DPI, layout="constrained")
    return fig, fig.add_subplot()


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _png(fig) -> bytes:
    """Render on a private Agg canvas, without the version string PNG metadata would carry."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()


def _series(steps: Steps, field: Literal["loss", "scale"]) -> tuple[list[int], list[float]]:
    return [s.step for s in steps], [float(getattr(s, field)) for s in steps]


def _flat(value) -> np.ndarray:
    return np.asarray(value, dtype=np.float64).reshape(-1)
