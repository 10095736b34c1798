"""One report for every variant side by side: the verdict first, then key figures, plots, and hashes last.

Pure: the loaded stage outputs in, text out. ``html`` is the self-contained page (the report stage's
PNGs embedded as base64) that publish uploads to the pipeline's MLflow run; ``markdown`` is the same
summary without images, which MLflow shows as that run's description. Both open with the verdict block
(``pipeline.present.verdict``): a reviewer reads the decision, its reasons, the flipped cases, the gain and the
next commands before any table; hashes and environment go to a footer. No timestamps, no absolute
paths: the same inputs give the same bytes. It quotes benchmark timings, which is why it is not a DVC
output (those must be byte-identical on a rerun).
"""

from __future__ import annotations

import base64
import html as _html
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeline.heads import Roles
from pipeline.present import verdict

# Plot files of one variant, in the order the report shows them, with their captions.
PLOTS = (
    ("loss", "Training loss per step: FP32 and AMP (top), AMP's gap against the band the rule allows (bottom)"),
    ("scale", "GradScaler loss scale per step, skipped updates marked"),
    ("envelope", "Error per output element against the tolerance envelope atol + rtol*|reference|; flipped cases ringed"),
    ("errors", "Absolute error histogram, tolerance marked"),
)


def rows(variants: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """The side-by-side table: one (label, [cell per variant]) row per key figure.

    Each variant is a mapping with ``variant``, ``decision`` (decision.json), ``metrics`` (compare's
    stats.json, flattened by ``files.flatten``), ``diagnosis`` (diagnosis.json), ``benchmark`` (benchmark.json) and,
    optionally, ``audit`` (the trial's audit.json).
    """

    def metric(key: str) -> Callable[[Mapping], str]:
        return lambda v: number(v["metrics"].get(key))

    outputs = sorted({k.split(".")[1] for v in variants for k in v["metrics"] if k.startswith("values.") and k.count(".") == 2})
    table: list[tuple[str, Callable[[Mapping], str]]] = [
        ("decision", lambda v: v["decision"]["decision"].upper()),
        ("inference under AMP", lambda v: str(v["decision"].get("inference", "-")).upper()),
        ("training under AMP", lambda v: str(v["decision"].get("training", "-")).upper()),
        ("reasons", lambda v: str(len(v["decision"]["reasons"]))),
        ("quality: reference", metric("quality.reference")),
        ("quality: AMP inference", metric("quality.trial")),
        ("quality: AMP after training", metric("quality.trained")),
        ("decision flips: real samples with a clear margin", metric("flips.flips")),
        ("decision flips: real samples near the boundary (margin < boundary_margin)", _near),
        ("decision flips: constructed boundary cases", _constructed),
    ]
    for name in outputs:
        table += [
            (f"'{name}': max |error|", metric(f"values.{name}.max_abs")),
            (f"'{name}': p99 |error|", metric(f"values.{name}.p99_abs")),
            (f"'{name}': fraction outside tolerance", metric(f"values.{name}.failing_fraction")),
            (f"'{name}': non-finite where FP32 is finite", metric(f"values.{name}.nonfinite_trial_only")),
        ]
        if any(v["metrics"].get(f"values.{name}.zero_probability_both") for v in variants):  # masked classes, said once seen
            table.append((f"'{name}': pairs at probability 0 on both sides (masked classes, set aside)",
                          metric(f"values.{name}.zero_probability_both")))
    if any("distribution.kl_mean" in v["metrics"] for v in variants):  # per-token outputs (language models)
        table += [
            ("distribution: KL(reference || AMP) per token, mean (nats)", metric("distribution.kl_mean")),
            ("distribution: KL per token, p99 (nats)", metric("distribution.kl_p99")),
            ("distribution: KL per token, max (nats)", metric("distribution.kl_max")),
            ("distribution: same top-1 token as the reference", metric("distribution.top1_agreement")),
            ("distribution: top-k overlap", metric("distribution.top_k_overlap")),
        ]
    table += [
        ("training: max loss gap", metric("training.max_loss_gap")),
        ("training: steps outside loss band", metric("training.band_violations")),
        (
            "training: FP32 noise floor, largest gap of the replicate (another data order)",
            metric("training.noise.max_replicate_gap"),
        ),
        ("training: AMP loss gap against the noise band (multiple x replicate gap + atol)", _noise_band),
        ("training: GradScaler", lambda v: "on" if v["metrics"].get("training.scaler_enabled") else "off (no GradScaler)"),
        ("training: skipped fraction", metric("training.skipped_fraction")),
        ("training: real updates", metric("training.real_updates")),
        ("training: final loss scale", metric("training.final_scale")),
        ("diagnosis findings", lambda v: str(len(v["diagnosis"].get("findings", [])))),
        ("AMP engaged: matmul, convolution and attention FLOPs in reduced precision", _engaged),
        ("FP16 forecast (float16 variants)", lambda v: (v["diagnosis"].get("forecast") or {}).get("recommendation", "-")),
        ("FP16 forecast against the trial", _forecast_held),
        ("benchmark: speed, FP32 time / AMP time (median, 95 % interval, FP32 against itself)", _speedup),
        ("benchmark: ms/step FP32 (median)", lambda v: _ms(v, "fp32")),
        ("benchmark: ms/step AMP (median)", lambda v: _ms(v, "amp")),
        ("benchmark: working memory FP32 (peak above baseline)", lambda v: _memory(v, "working_memory_bytes", "fp32")),
        ("benchmark: working memory AMP (peak above baseline)", lambda v: _memory(v, "working_memory_bytes", "amp")),
        ("benchmark: working memory AMP / FP32", lambda v: _ratio(v, "working_memory_ratio")),
        ("benchmark: process peak memory FP32 (incl. torch itself)", lambda v: _memory(v, "peak_memory_bytes", "fp32")),
        ("benchmark: process peak memory AMP (incl. torch itself)", lambda v: _memory(v, "peak_memory_bytes", "amp")),
    ]
    return [(label, [cell(v) for v in variants]) for label, cell in table]


def verdicts_of(variants: Sequence[Mapping[str, Any]]) -> list[verdict.Verdict]:
    """The verdict of every variant from its outputs (publish passes its own, with the loosened-rule flag)."""
    return [
        verdict.verdict(v["variant"], v["decision"], v.get("stats"), v.get("diagnosis"), v.get("benchmark"), audit=v.get("audit"))
        for v in variants
    ]


def markdown(
    reference: Mapping[str, Any], variants: Sequence[Mapping[str, Any]], verdicts: Sequence[verdict.Verdict] | None = None
) -> str:
    """The summary as Markdown (MLflow run description, pull-request comments): verdict, table, footer."""
    verdicts = verdicts_of(variants) if verdicts is None else verdicts
    names = [v["variant"] for v in variants]
    # The headline first: MLflow shows a description's first lines only, until "Show more".
    out = [verdict.headline(verdicts), "# AMP validation", "", verdict.markdown(verdicts), "## Key figures", ""]
    out += ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {_cell(label)} | " + " | ".join(_cell(c) for c in cells) + " |" for label, cells in rows(variants)]
    out += _roles_markdown(reference)
    out += ["", "---", "", f"Reference: {_env(reference['env'])}; {_cases(reference.get('cases', {}))}.  ",
            f"Acceptance rule sha256 `{reference['rule_sha256']}`; reference run key `{reference['run_key']}`."]
    return "\n".join(out) + "\n"


def html(
    reference: Mapping[str, Any],
    variants: Sequence[Mapping[str, Any]],
    images: Mapping[str, Mapping[str, bytes]],
    verdicts: Sequence[verdict.Verdict] | None = None,
) -> str:
    """The self-contained HTML report; ``images[variant][plot]`` are PNG bytes (see ``PLOTS``)."""
    e = _html.escape
    verdicts = verdicts_of(variants) if verdicts is None else verdicts
    head = "".join(f"<th>{e(v['variant'])}</th>" for v in variants)
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
        d, decision = v["variant"], v["decision"]
        parts.append(
            f'<h2 id="{e(d)}">{e(d)}: <span class="{e(decision["decision"])}">{e(decision["decision"].upper())}</span></h2>'
        )
        reasons = decision["reasons"]
        parts.append(
            "<h3>Reasons</h3><ul>"
            + ("".join(f"<li>{e(r)}</li>" for r in reasons) or "<li>every criterion of the rule passed</li>")
            + "</ul>"
        )
        checks = decision.get("checks", [])
        if checks:
            parts.append(
                f"<details><summary>{len(checks)} passing check(s)</summary><ul>"
                + "".join(f"<li>{e(c)}</li>" for c in checks)
                + "</ul></details>"
            )
        findings = v["diagnosis"].get("findings", [])
        if findings:
            parts.append("<h3>Diagnosis</h3><ul>" + "".join(f"<li>{e(f)}</li>" for f in findings) + "</ul>")
        parts.append(_precision(v))
        bench = v["benchmark"]
        if not bench.get("benchmarked"):
            parts.append(f"<p>Benchmark: {e(str(bench.get('reason', 'not benchmarked')))}</p>")
        figures = images.get(d, {})
        parts.append('<div class="plots">')
        for name, caption in PLOTS:
            if name in figures:
                data = base64.b64encode(figures[name]).decode("ascii")
                parts.append(
                    f'<figure data-plot="{e(d)}/{e(name)}"><img alt="{e(caption)} ({e(d)})" src="data:image/png;base64,{data}">'
                    f"<figcaption>{e(caption)}</figcaption></figure>"
                )
        parts.append("</div>")
    roles = Roles.from_dict(reference.get("roles"))
    if roles is not None:  # freeze's role table: how every variant's outputs were judged
        header, *lines = _role_rows(roles)
        parts.append("<h2>Outputs, as judged</h2><table class=\"summary\"><tr>" + "".join(f"<th>{e(c)}</th>" for c in header)
                     + "</tr>" + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in lines) + "</table>"
                     + "<p>State a role under <code>acceptance.outputs.NAME.role</code> (docs/outputs.md).</p>")
    parts.append(
        f'<footer><p>Reference: {e(_env(reference["env"]))}; {e(_cases(reference.get("cases", {})))}<br>'
        f"Acceptance rule sha256 <code>{e(reference['rule_sha256'])}</code><br>"
        f"Reference run key <code>{e(reference['run_key'])}</code></p></footer>"
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
    "pre{background:#f0f0f0;padding:6px;overflow-x:auto}footer{color:#666;font-size:.9em;margin-top:2em}"
)


def _role_rows(roles: Roles) -> list[tuple[str, ...]]:
    """The role table's header and one row per output (``heads.Roles``)."""
    rows = [("output", "shape", "role", "decided", "atol", "rtol", "scale")]
    for h in roles.heads:
        rows.append((h.name + " (primary)" * h.primary, "x".join(map(str, h.shape)) or "1",
                     f"{h.role} ({'stated' if h.stated else 'inferred'})", h.decided, f"{h.atol:g}", f"{h.rtol:g}",
                     "-" if h.scale is None else f"{h.scale:.3g}"))
    return rows


def _roles_markdown(reference: Mapping[str, Any]) -> list[str]:
    roles = Roles.from_dict(reference.get("roles"))
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


def _near(v: Mapping) -> str:
    m = v["metrics"]
    if "flips.near_boundary_flips" not in m:
        return "-"
    cases = m.get("flips.near_boundary_cases")
    return f"{number(m['flips.near_boundary_flips'])}" + (f" of {number(cases)}" if cases is not None else "")


def _constructed(v: Mapping) -> str:
    m = v["metrics"]
    return f"{number(m.get('flips.boundary_flips'))} of {number(m.get('flips.boundary_cases'))}"


def _engaged(v: Mapping) -> str:
    a = v.get("audit")
    if not a:
        return "-"
    share = f"{100 * ((a.get('total') or {}).get('reduced_share') or 0.0):.1f} %"
    return f"{share}, FLAGGED: speedup claim unsupported" if a.get("flagged") else share


def _forecast_held(v: Mapping) -> str:
    checked = v["diagnosis"].get("forecast")
    return "-" if not checked else "held" if checked["held"] else "missed"


def _precision(v: Mapping) -> str:
    """What ran in reduced precision (the audit, with the ops left in FP32) and, for float16, the forecast and its check."""
    e = _html.escape
    a, checked = v.get("audit"), v["diagnosis"].get("forecast")
    items = [f"<li>audit: {e(a['line'])}</li>"] if a else []
    stayed = (a or {}).get("stayed_fp32") or []
    if stayed:
        items.append(
            f"<li>ops left in FP32 that no fp32_modules asked for ({len(stayed)}, largest first):<ul>"
            + "".join(f"<li>{e(_op(o))}</li>" for o in stayed[:MAX_OPS]) + "</ul></li>"
        )
    if checked:
        items += [f"<li>FP16 forecast: {e(checked['forecast'])}</li>", f"<li>{e(checked['line'])}</li>"]
    return "<h3>Precision</h3><ul>" + "".join(items) + "</ul>" if items else ""


MAX_OPS = 10
"""Ops left in FP32 listed per variant on the page; every one is in the trial's audit.json."""


def _op(o: Mapping) -> str:
    shapes = " x ".join("[" + ",".join(map(str, s)) + "]" for s in o["shapes"])
    where = f"module {o['module']!r}" if o["module"] else "the model's own code"
    return f"{o['op']} {shapes} {o['precision']} in {where} ({o['phase']}), {100 * o['share']:.1f} % of the FLOPs"


def _speedup(v: Mapping) -> str:
    """The speed verdict with its interval and FP32's against itself (``verdict.speed_words``), never a bare ratio."""
    b = v["benchmark"]
    if not b.get("benchmarked"):
        return "not benchmarked"
    return verdict.speed_words(b) or "-"


def _ms(v: Mapping, name: str) -> str:
    median = v["benchmark"].get("seconds_per_step", {}).get(name, {}).get("median")
    return "-" if median is None else f"{1000 * median:.3g} ms"


def _memory(v: Mapping, field: str, name: str) -> str:
    median = v["benchmark"].get(field, {}).get(name, {}).get("median")
    return "-" if median is None else f"{median / 2**20:.1f} MiB"


def _noise_band(v: Mapping) -> str:
    """What the noise gate compared: AMP's mean and largest loss gap against multiple x the replicate's + atol.

    Not their ratio: a replicate that follows FP32 exactly (gap 0) makes it infinite, which is no figure.
    """
    m = v["metrics"]
    amp = (m.get("training.noise.mean_amp_gap"), m.get("training.noise.max_amp_gap"))
    rep = (m.get("training.noise.mean_replicate_gap"), m.get("training.noise.max_replicate_gap"))
    if None in amp or None in rep:
        return "-"
    multiple, atol = m.get("training.noise.multiple"), m.get("training.noise.atol")
    if multiple is None and atol is None:
        return (f"no band set (acceptance.loss_noise_multiple): mean {number(amp[0])}, max {number(amp[1])}; "
                f"replicate mean {number(rep[0])}, max {number(rep[1])}")
    k, a = multiple or 0.0, atol or 0.0
    allowed = [k * r + a for r in rep]
    return ", ".join(
        f"{name} {number(x)} {'<=' if x <= limit else '>'} {number(limit)}"
        for name, x, limit in zip(("mean", "max"), amp, allowed)
    )


def _ratio(v: Mapping, field: str) -> str:
    median = v["benchmark"].get(field, {}).get("median")
    return "-" if median is None else f"x{median:.2f}"


def _env(env: Mapping[str, Any]) -> str:
    if not env:
        return "environment not recorded"
    return f"backend {env.get('backend', '?')}, device {env.get('device_name', '?')}, torch {env.get('torch', '?')}"


def _cases(cases: Mapping[str, Any]) -> str:
    if not cases:
        return "cases not recorded"
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(cases.items()) if k != "total")
    return f"{cases.get('total', '?')} fixed cases ({kinds})"
