"""One report for every variant side by side: the verdict first, then key figures, plots, and hashes last.

Pure: the reference's manifest and the loaded variants (``pipeline.artifacts.variant.Variant``, typed records) in,
text out. ``html`` is the self-contained page (the report stage's PNGs embedded as base64) that publish uploads
to the pipeline's MLflow run; ``markdown`` is the same summary without images, which MLflow shows as that run's
description. Both open with the verdict block (``pipeline.present.verdict``): a reviewer reads the decision, its
reasons, the flipped cases, the gain and the next commands before any table; hashes and environment go to a
footer. No timestamps, no absolute paths: the same inputs give the same bytes. It quotes benchmark timings,
which is why it is not a DVC output (those must be byte-identical on a rerun).
"""

from __future__ import annotations

import base64
import html as _html
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.heads import Roles
from pipeline.present import verdict

if TYPE_CHECKING:
    from pipeline.artifacts.audit import AuditedOp
    from pipeline.artifacts.comparison import Stats
    from pipeline.artifacts.reference import Manifest
    from pipeline.artifacts.variant import Variant

# Plot files of one variant, in the order the report shows them, with their captions.
PLOTS = (
    ("loss", "Training loss per step: FP32 and AMP (top), AMP's gap against the band the rule allows (bottom)"),
    ("scale", "GradScaler loss scale per step, skipped updates marked"),
    ("envelope", "Error per output element against the tolerance envelope atol + rtol*|reference|; flipped cases ringed"),
    ("errors", "Absolute error histogram, tolerance marked"),
)


def rows(variants: Sequence[Variant]) -> list[tuple[str, list[str]]]:
    """The side-by-side table: one (label, [cell per variant]) row per key figure ("-" where a variant has none: a
    failed trial has no statistics, a rolled-back variant no benchmark)."""

    def stat(figure: Callable[[Stats], Any]) -> Callable[[Variant], str]:
        return lambda v: "-" if v.stats is None else number(figure(v.stats))

    def value(name: str, figure: str) -> Callable[[Variant], str]:  # one output's gap figure, where it has that output
        return stat(lambda s: getattr(s.values[name], figure) if name in s.values else None)

    def kl(figure: str) -> Callable[[Variant], str]:
        return stat(lambda s: None if s.distribution is None else getattr(s.distribution, figure))

    def noise(figure: str) -> Callable[[Variant], str]:
        return stat(lambda s: None if s.training.noise is None else getattr(s.training.noise, figure))

    compared = [v.stats for v in variants if v.stats is not None]
    outputs = sorted({name for s in compared for name in s.values})
    table: list[tuple[str, Callable[[Variant], str]]] = [
        ("decision", lambda v: v.decision.decision.upper()),
        ("inference under AMP", lambda v: v.decision.inference.upper()),
        ("training under AMP", lambda v: v.decision.training.upper()),
        ("reasons", lambda v: str(len(v.decision.reasons))),
        ("quality: reference", stat(lambda s: s.quality.reference)),
        ("quality: AMP inference", stat(lambda s: s.quality.trial)),
        ("quality: AMP after training", stat(lambda s: s.quality.trained)),
        ("decision flips: real samples with a clear margin", stat(lambda s: s.flips.flips)),
        ("decision flips: real samples near the boundary (margin < boundary_margin)", _near),
        ("decision flips: constructed boundary cases", _constructed),
    ]
    for name in outputs:
        table += [
            (f"'{name}': max |error|", value(name, "max_abs")),
            (f"'{name}': p99 |error|", value(name, "p99_abs")),
            (f"'{name}': fraction outside tolerance", value(name, "failing_fraction")),
            (f"'{name}': non-finite where FP32 is finite", value(name, "nonfinite_trial_only")),
        ]
        if any(name in s.values and s.values[name].zero_probability_both for s in compared):  # masked classes, once seen
            table.append((f"'{name}': pairs at probability 0 on both sides (masked classes, set aside)",
                          value(name, "zero_probability_both")))
    if any(s.distribution is not None for s in compared):  # per-token outputs (language models)
        table += [
            ("distribution: KL(reference || AMP) per token, mean (nats)", kl("kl_mean")),
            ("distribution: KL per token, p99 (nats)", kl("kl_p99")),
            ("distribution: KL per token, max (nats)", kl("kl_max")),
            ("distribution: same top-1 token as the reference", kl("top1_agreement")),
            ("distribution: top-k overlap", kl("top_k_overlap")),
        ]
    table += [
        ("training: max loss gap", stat(lambda s: s.training.max_loss_gap)),
        ("training: steps outside loss band", stat(lambda s: s.training.band_violations)),
        ("training: FP32 noise floor, largest gap of the replicate (another data order)", noise("max_replicate_gap")),
        ("training: AMP loss gap against the noise band (multiple x replicate gap + atol)", _noise_band),
        ("training: GradScaler", _scaler),
        ("training: skipped fraction", stat(lambda s: s.training.skipped_fraction)),
        ("training: real updates", stat(lambda s: s.training.real_updates)),
        ("training: final loss scale", stat(lambda s: s.training.final_scale)),
        ("diagnosis findings", lambda v: str(len(v.diagnosis.findings))),
        ("AMP engaged: matmul, convolution and attention FLOPs in reduced precision", _engaged),
        ("FP16 forecast (float16 variants)", lambda v: v.diagnosis.forecast.recommendation if v.diagnosis.forecast else "-"),
        ("FP16 forecast against the trial", _forecast_held),
        ("benchmark: speed, FP32 time / AMP time (median, 95 % interval, FP32 against itself)", _speedup),
        ("benchmark: ms/step FP32 (median)", lambda v: _ms(v, "fp32")),
        ("benchmark: ms/step AMP (median)", lambda v: _ms(v, "amp")),
        ("benchmark: working memory FP32 (peak above baseline)", lambda v: _memory(v, "working_memory_bytes", "fp32")),
        ("benchmark: working memory AMP (peak above baseline)", lambda v: _memory(v, "working_memory_bytes", "amp")),
        ("benchmark: working memory AMP / FP32", _working_ratio),
        ("benchmark: process peak memory FP32 (incl. torch itself)", lambda v: _memory(v, "peak_memory_bytes", "fp32")),
        ("benchmark: process peak memory AMP (incl. torch itself)", lambda v: _memory(v, "peak_memory_bytes", "amp")),
    ]
    return [(label, [cell(v) for v in variants]) for label, cell in table]


def verdicts_of(variants: Sequence[Variant]) -> list[verdict.Verdict]:
    """The verdict of every variant from its records (publish passes its own, with the loosened-rule flag)."""
    return [verdict.of(v) for v in variants]


def markdown(reference: Manifest, variants: Sequence[Variant], verdicts: Sequence[verdict.Verdict] | None = None) -> str:
    """The summary as Markdown (MLflow run description, pull-request comments): verdict, table, footer."""
    verdicts = verdicts_of(variants) if verdicts is None else verdicts
    names = [v.name for v in variants]
    # The headline first: MLflow shows a description's first lines only, until "Show more".
    out = [verdict.headline(verdicts), "# AMP validation", "", verdict.markdown(verdicts), "## Key figures", ""]
    out += ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {_cell(label)} | " + " | ".join(_cell(c) for c in cells) + " |" for label, cells in rows(variants)]
    out += _roles_markdown(reference)
    out += ["", "---", "", f"Reference: {_env(reference.env)}; {_cases(reference.cases)}.  ",
            f"Acceptance rule sha256 `{reference.rule_sha256}`; reference run key `{reference.run_key}`."]
    return "\n".join(out) + "\n"


def html(reference: Manifest, variants: Sequence[Variant], verdicts: Sequence[verdict.Verdict] | None = None) -> str:
    """The self-contained HTML report; each variant's figures (``Variant.plots``, PNG bytes) in the order of ``PLOTS``."""
    e = _html.escape
    verdicts = verdicts_of(variants) if verdicts is None else verdicts
    head = "".join(f"<th>{e(v.name)}</th>" for v in variants)
    body = []
    for label, cells in rows(variants):
        css = [f' class="{c.lower()}"' if c in ("ACCEPT", "ROLLBACK") else "" for c in cells]
        body.append(f"<tr><th>{e(label)}</th>" + "".join(f"<td{k}>{e(c)}</td>" for k, c in zip(css, cells)) + "</tr>")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>AMP validation report</title>',
        f"<style>{_CSS}</style></head><body>",
        "<h1>AMP validation report</h1>",
        verdict.html(verdicts),
        "<h2>Key figures, variants side by side</h2>",
        f'<table class="summary"><tr><th></th>{head}</tr>',
        *body,
        "</table>",
    ]
    for v in variants:
        d, decision = v.name, v.decision
        parts.append(
            f'<h2 id="{e(d)}">{e(d)}: <span class="{e(decision.decision)}">{e(decision.decision.upper())}</span></h2>'
        )
        parts.append(
            "<h3>Reasons</h3><ul>"
            + ("".join(f"<li>{e(r)}</li>" for r in decision.reasons) or "<li>every criterion of the rule passed</li>")
            + "</ul>"
        )
        if decision.checks:
            parts.append(
                f"<details><summary>{len(decision.checks)} passing check(s)</summary><ul>"
                + "".join(f"<li>{e(c)}</li>" for c in decision.checks)
                + "</ul></details>"
            )
        if v.diagnosis.findings:
            parts.append("<h3>Diagnosis</h3><ul>" + "".join(f"<li>{e(f)}</li>" for f in v.diagnosis.findings) + "</ul>")
        parts.append(_precision(v))
        if not v.benchmark.benchmarked:
            parts.append(f"<p>Benchmark: {e(str(v.benchmark.reason))}</p>")
        parts.append('<div class="plots">')
        for name, caption in PLOTS:
            if name in v.plots:
                data = base64.b64encode(v.plots[name]).decode("ascii")
                parts.append(
                    f'<figure data-plot="{e(d)}/{e(name)}"><img alt="{e(caption)} ({e(d)})" src="data:image/png;base64,{data}">'
                    f"<figcaption>{e(caption)}</figcaption></figure>"
                )
        parts.append("</div>")
    roles = Roles.read(reference.roles)
    if roles is not None:  # freeze's role table: how every variant's outputs were judged
        header, *lines = _role_rows(roles)
        parts.append("<h2>Outputs, as judged</h2><table class=\"summary\"><tr>" + "".join(f"<th>{e(c)}</th>" for c in header)
                     + "</tr>" + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in lines) + "</table>"
                     + "<p>State a role under <code>acceptance.outputs.NAME.role</code> (docs/outputs.md).</p>")
    parts.append(
        f'<footer><p>Reference: {e(_env(reference.env))}; {e(_cases(reference.cases))}<br>'
        f"Acceptance rule sha256 <code>{e(reference.rule_sha256)}</code><br>"
        f"Reference run key <code>{e(reference.run_key)}</code></p></footer>"
    )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


_CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px}"
    "table.summary{border-collapse:collapse}th,td{border:1px solid #ccc;padding:4px 10px;text-align:left}"
    "td{font-family:monospace}.accept{color:#176b2c;font-weight:bold}.rollback{color:#b00020;font-weight:bold}"
    ".plots{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0}img{max-width:640px}"
    "#verdict .verdict{border-left:6px solid #999;padding:2px 12px;margin:8px 0;background:#fafafa}"
    "#verdict .v-accept{border-color:#176b2c}#verdict .v-rollback{border-color:#b00020}"
    ".sentence{font-size:1.15em;font-weight:bold}.warning{color:#8a5a00;font-weight:bold}"
    # the "Next" box: a command longer than the page wraps instead of being cut off at the right
    "pre{background:#f0f0f0;padding:6px;white-space:pre-wrap;overflow-wrap:anywhere}"
    "footer{color:#666;font-size:.9em;margin-top:2em}"
)


def _role_rows(roles: Roles) -> list[tuple[str, ...]]:
    """The role table's header and one row per output (``heads.Roles``)."""
    rows = [("output", "shape", "role", "decided", "atol", "rtol", "scale")]
    for h in roles.heads:
        rows.append((h.name + " (primary)" * h.primary, "x".join(map(str, h.shape)) or "1",
                     f"{h.role} ({'stated' if h.stated else 'inferred'})", h.decided, f"{h.atol:g}", f"{h.rtol:g}",
                     "-" if h.scale is None else f"{h.scale:.3g}"))
    return rows


def _roles_markdown(reference: Manifest) -> list[str]:
    roles = Roles.read(reference.roles)
    if roles is None:
        return []
    header, *lines = _role_rows(roles)
    return ["", "## Outputs, as judged", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|",
            *("| " + " | ".join(_cell(c) for c in r) + " |" for r in lines)]


def _cell(text: str) -> str:
    """A Markdown table cell: a bare ``|`` would end it."""
    return text.replace("|", "\\|")


def number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


def _near(v: Variant) -> str:
    if v.stats is None:
        return "-"
    return f"{number(v.stats.flips.near_boundary_flips)} of {number(v.stats.flips.near_boundary_cases)}"


def _constructed(v: Variant) -> str:
    flips = v.stats.flips if v.stats is not None else None
    return f"{number(flips and flips.boundary_flips)} of {number(flips and flips.boundary_cases)}"


def _scaler(v: Variant) -> str:
    return "on" if v.stats is not None and v.stats.training.scaler_enabled else "off (no GradScaler)"


def _engaged(v: Variant) -> str:
    if v.audit is None:
        return "-"
    share = f"{100 * (v.audit.total.reduced_share or 0.0):.1f} %"
    return f"{share}, FLAGGED: speedup claim unsupported" if v.audit.flagged else share


def _forecast_held(v: Variant) -> str:
    checked = v.diagnosis.forecast
    return "-" if not checked else "held" if checked.held else "missed"


def _precision(v: Variant) -> str:
    """What ran in reduced precision (the audit, with the ops left in FP32) and, for float16, the forecast and its check."""
    e = _html.escape
    a, checked = v.audit, v.diagnosis.forecast
    items = [f"<li>audit: {e(a.line)}</li>"] if a else []
    stayed = a.stayed_fp32 if a else ()
    if stayed:
        items.append(
            f"<li>ops left in FP32 that no fp32_modules asked for ({len(stayed)}, largest first):<ul>"
            + "".join(f"<li>{e(_op(o))}</li>" for o in stayed[:MAX_OPS]) + "</ul></li>"
        )
    if checked:
        items += [f"<li>FP16 forecast: {e(checked.forecast)}</li>", f"<li>{e(checked.line)}</li>"]
    return "<h3>Precision</h3><ul>" + "".join(items) + "</ul>" if items else ""


MAX_OPS = 10
"""Ops left in FP32 listed per variant on the page; every one is in the trial's audit.json."""


def _op(o: AuditedOp) -> str:
    shapes = " x ".join("[" + ",".join(map(str, s)) + "]" for s in o.shapes)
    where = f"module {o.module!r}" if o.module else "the model's own code"
    return f"{o.op} {shapes} {o.precision} in {where} ({o.phase}), {100 * o.share:.1f} % of the FLOPs"


def _speedup(v: Variant) -> str:
    """The speed verdict with its interval and FP32's against itself (``verdict.speed_words``), never a bare ratio."""
    if not v.benchmark.benchmarked:
        return "not benchmarked"
    return verdict.speed_words(v.benchmark) or "-"


def _ms(v: Variant, arm: str) -> str:
    b = v.benchmark
    spread = (b.seconds_per_step or {}).get(arm) if b.benchmarked else None
    return "-" if spread is None else f"{1000 * spread.median:.3g} ms"


def _memory(v: Variant, field: str, arm: str) -> str:
    """``field``: ``peak_memory_bytes`` or ``working_memory_bytes`` (``benchmark.MemorySummary``)."""
    b = v.benchmark
    spread = getattr(b.memory, field).get(arm) if b.benchmarked else None
    return "-" if spread is None else f"{spread.median / 2**20:.1f} MiB"


def _working_ratio(v: Variant) -> str:
    b = v.benchmark
    spread = b.memory.working_memory_ratio if b.benchmarked else None
    return "-" if spread is None else f"x{spread.median:.2f}"


def _noise_band(v: Variant) -> str:
    """What the noise gate compared: AMP's mean and largest loss gap against multiple x the replicate's + atol.

    Not their ratio: a replicate that follows FP32 exactly (gap 0) makes it infinite, which is no figure.
    """
    n = v.stats.training.noise if v.stats is not None else None
    if n is None:
        return "-"
    amp, rep = (n.mean_amp_gap, n.max_amp_gap), (n.mean_replicate_gap, n.max_replicate_gap)
    if n.multiple is None and n.atol is None:
        return (f"no band set (acceptance.loss_noise_multiple): mean {number(amp[0])}, max {number(amp[1])}; "
                f"replicate mean {number(rep[0])}, max {number(rep[1])}")
    k, a = n.multiple or 0.0, n.atol or 0.0
    allowed = [k * r + a for r in rep]
    return ", ".join(
        f"{name} {number(x)} {'<=' if x <= limit else '>'} {number(limit)}"
        for name, x, limit in zip(("mean", "max"), amp, allowed)
    )


def _env(env: Mapping[str, Any]) -> str:
    if not env:
        return "environment not recorded"
    return f"backend {env.get('backend', '?')}, device {env.get('device_name', '?')}, torch {env.get('torch', '?')}"


def _cases(cases: Mapping[str, Any]) -> str:
    if not cases:
        return "cases not recorded"
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(cases.items()) if k != "total")
    return f"{cases.get('total', '?')} fixed cases ({kinds})"
