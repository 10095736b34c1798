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
from collections.abc import Callable, Mapping, Sequence

import numpy as np

# One size for every figure: readable in the MLflow artifact viewer and small inside the HTML report.
_SIZE = (6.4, 3.6)
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


def curve_rows(ref_steps: Sequence[Mapping], trial_steps: Sequence[Mapping]) -> dict[str, list[dict]]:
    """Flat per-step rows for `dvc plots`: ``loss`` (FP32 vs AMP) and ``scale`` (loss scale, skipped).

    The FP32 and AMP losses sit in two trajectory files, and a plot that names those files would have
    to name every dtype in dvc.yaml. These rows put both losses in one record with fixed field names;
    the report stage writes one file per dtype into a folder that dvc.yaml declares as a whole.
    """
    ref_loss = {int(s["step"]): s["loss"] for s in ref_steps}
    loss = [{"step": int(s["step"]), "loss_fp32": ref_loss.get(int(s["step"]), math.nan), "loss_amp": s["loss"]} for s in trial_steps]
    scale = [{"step": int(s["step"]), "scale": s["scale"], "skipped": int(bool(s["skipped"]))} for s in trial_steps]
    return {"loss": loss, "scale": scale}


@_styled
def loss_curves(ref_steps: Sequence[Mapping], trial_steps: Sequence[Mapping], dtype: str) -> bytes:
    """Training loss per step, FP32 reference against the AMP trial; non-finite AMP losses marked."""
    fig, ax = _figure()
    rs, rl = _series(ref_steps, "loss")
    ts, tl = _series(trial_steps, "loss")
    ax.plot(rs, rl, color=_FP32, label="FP32 reference", linewidth=1.5)
    ax.plot(ts, tl, color=_AMP, label=f"AMP {dtype}", linewidth=1.2, linestyle="--")
    bad = [s for s, v in zip(ts, tl) if not math.isfinite(v)]
    for s in bad:
        ax.axvline(s, color=_BAD, alpha=0.3, linewidth=1)
    if bad:
        ax.plot([], [], color=_BAD, alpha=0.5, label=f"non-finite AMP loss ({len(bad)} steps, first {bad[0]})")
    ax.set(xlabel="step", ylabel="training loss", title=f"Loss per step: FP32 vs AMP {dtype}")
    _integer_steps(ax)
    ax.legend(loc="upper right")
    return _png(fig)


@_styled
def loss_scale(trial_steps: Sequence[Mapping], dtype: str) -> bytes:
    """GradScaler loss scale per step (log scale), skipped updates marked with a red cross."""
    fig, ax = _figure()
    steps, scales = _series(trial_steps, "scale")
    ax.step(steps, scales, where="post", color=_AMP, label="loss scale")
    skipped = [(int(s["step"]), float(s["scale"])) for s in trial_steps if s["skipped"]]
    if skipped:
        ax.plot([s for s, _ in skipped], [v for _, v in skipped], "x", color=_BAD, markersize=7, label=f"skipped update ({len(skipped)})")
    else:
        ax.plot([], [], "x", color=_BAD, label="skipped update (none)")
    finite = [v for v in scales if math.isfinite(v) and v > 0]
    if finite:
        ax.set_yscale("log", base=2)  # the scaler halves and doubles: powers of two read best
    title = f"Loss scale per step: AMP {dtype}"
    if finite and max(finite) == min(finite) == 1.0:
        title += "\n(GradScaler disabled: scale fixed at 1)"
    ax.set(xlabel="step", ylabel="loss scale", title=title)
    _integer_steps(ax)
    ax.legend(loc="lower left")
    return _png(fig)


@_styled
def scores(reference: Mapping[str, np.ndarray], trial: Mapping[str, np.ndarray], dtype: str) -> bytes:
    """Every output element, reference against trial, one colour per named output; y = x drawn."""
    fig, ax = _figure(square=True)
    lo, hi, dropped = math.inf, -math.inf, 0
    for name in sorted(reference):
        r, t = _flat(reference[name]), _flat(trial[name])
        keep = np.isfinite(r) & np.isfinite(t)
        dropped += int((~keep).sum())
        if keep.any():
            ax.scatter(r[keep], t[keep], s=6, alpha=0.5, label=f"{name} ({int(keep.sum())} values)")
            lo, hi = min(lo, float(r[keep].min()), float(t[keep].min())), max(hi, float(r[keep].max()), float(t[keep].max()))
    if math.isfinite(lo):
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="trial = reference")
    title = f"Outputs: FP32 reference vs AMP {dtype}"
    if dropped:
        title += f"\n{dropped} non-finite value(s) not drawn"
    ax.set(xlabel="FP32 reference", ylabel=f"AMP {dtype}", title=title)
    ax.legend(loc="upper left", fontsize="small")
    return _png(fig)


@_styled
def error_histogram(
    reference: Mapping[str, np.ndarray],
    trial: Mapping[str, np.ndarray],
    tolerances: Mapping[str, float],
    dtype: str,
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
    ax.set(xlabel="|AMP - FP32| per element", ylabel="elements", title=f"Absolute error, AMP {dtype} vs FP32")
    ax.legend(loc="upper right", fontsize="small")
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


def _series(steps: Sequence[Mapping], field: str) -> tuple[list[int], list[float]]:
    return [int(s["step"]) for s in steps], [float(s[field]) for s in steps]


def _flat(value) -> np.ndarray:
    return np.asarray(value, dtype=np.float64).reshape(-1)
