"""The verdict block: what a reviewer reads first, per variant, wherever they land.

Pure: the stages' typed records in (``pipeline.artifacts``: ``Decision``, ``Stats``, ``Diagnosis``, the benchmark's
record, ``Audit``; ``variant.Variant`` holds them all), text out (no torch, no MLflow, no clock). The same ``Verdict`` is
rendered as Markdown (MLflow descriptions), HTML (report.html), plain text (a stage's terminal note) and
one line (publish's last line). Per variant it says:

- the decision in one sentence, with the gain in the words of the benchmark's speed verdict, on the machine that
  benchmarked it ("x0.32 (3.1 times slower; 95 % interval 0.30-0.35; FP32 against itself 0.97-1.03) on AMD EPYC 7B13
  (CPU, AVX512): keep FP32 there"; "no measurable difference (x1.03, ...)" where the interval holds 1 or overlaps FP32
  against itself), then the time to FP32's final loss ("time to FP32's final loss: x1.25 (...)": a faster step
  that needs more updates is no switch to AMP);
- the reasons (the failed criteria, then the diagnosis' findings: two fields of the decision, never told
  apart by their words);
- the flipped cases, reference -> trial class and margin, calling out real samples that the rule counted
  as boundary cases only because their reference margin is small;
- whether training drifted (its loss gap against FP32's own, where it ended; "no GradScaler" for bfloat16);
- whether AMP engaged (the trial's audit: the share of matmul, convolution and attention FLOPs in reduced
  precision); a flagged audit marks the speedup claim unsupported, whatever the benchmark measured;
- for a float16 variant, freeze's FP16 headroom forecast and whether the trial bore it out;
- on rollback, the next commands, ready to paste: the suggested experiment first, then the restore.

Hashes and environment go to a footer, not here.
"""

from __future__ import annotations

import html as _html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the records import this module for their words: typed here, never imported at run time
    from pipeline.artifacts.audit import Audit
    from pipeline.artifacts.benchmark import Measured, Speed, TimeToQuality
    from pipeline.artifacts.comparison import Decisions, Stats
    from pipeline.artifacts.decision import Decision
    from pipeline.artifacts.diagnosis import Diagnosis
    from pipeline.artifacts.variant import Variant

MAX_FLIPS = 10
"""Flipped cases listed per variant; the rest are counted (every one is in compare's cases.json)."""


@dataclass
class Verdict:
    variant: str
    decision: str
    """``accept`` or ``rollback``."""
    sentence: str
    failed: str = ""
    """On rollback, how many criteria failed, in words ("1 criterion failed"): the sentence's core, alone for
    one-line summaries."""
    reasons: list[str] = field(default_factory=list)
    """The failed criteria, then the diagnosis' findings (each said as ``diagnosis: ...``)."""
    flips: list[str] = field(default_factory=list)
    training: str = ""
    audit: str = ""
    """The "AMP engaged" audit's sentence (``audit: ...``), when the trial's audit was given."""
    forecast: list[str] = field(default_factory=list)
    """Float16 only: the FP16 forecast's sentence, then its check against the trial (``forecast held: ...``)."""
    gain: str = ""
    commands: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def details(self) -> list[str]:
        """The lines said after the reasons and flips: training, the audit, the forecast and its check."""
        return [line for line in (self.training, self.audit, *self.forecast) if line]

    @property
    def short(self) -> str:
        """The decision and its gain in a few words, for run names and one-line summaries."""
        return f"{self.decision.upper()} {self.variant}"


def of(v: Variant, loosened: Sequence[str] = ()) -> Verdict:
    """The verdict of one loaded variant (``pipeline.artifacts.variant.load``); ``loosened`` as ``verdict`` takes it."""
    return verdict(v.name, v.decision, v.stats, v.diagnosis, v.benchmark, loosened, v.audit)


def verdict(
    variant: str,
    decision: Decision,
    stats: Stats | None = None,
    diagnosis: Diagnosis | None = None,
    benchmark: Measured | None = None,
    loosened: Sequence[str] = (),
    audit: Audit | None = None,
) -> Verdict:
    """The verdict of one variant from its records: the decision, compare's statistics, the diagnosis, the benchmark and
    the trial's audit (each but the decision may be absent: decide runs before the benchmark, a failed trial has no
    statistics and no audit). ``loosened``: how the rule was loosened since an earlier rollback of the same reference
    (publish)."""
    accepted = decision.accepted
    gain = (_unsupported(audit, benchmark) if audit and audit.flagged else _gain(benchmark)) if accepted else ""
    criteria = [str(r) for r in decision.reasons]
    failed = ""
    if accepted:
        passed = f"the rule passed, {gain}" if gain else "every criterion of the rule passed"
        sentence = f"{variant}: ACCEPT: {passed}"
        if decision.training == "not judged":  # an inference-only verdict must not read as a training one
            sentence += " (inference only: training not judged)"
    else:
        failed = f"{len(criteria)} criteria failed" if len(criteria) != 1 else "1 criterion failed"
        split = f" (inference {decision.inference.upper()}, training {decision.training.upper()})"
        sentence = f"{variant}: ROLLBACK: {failed}{split}; keep FP32 for {variant} (the reference state is restorable exactly)"
    out = Verdict(variant=variant, decision=decision.decision, sentence=sentence, failed=failed)
    out.reasons = criteria + [f"diagnosis: {f}" for f in decision.findings]
    out.flips = _flips(stats.flips, decision) if stats else []
    out.training = _training(stats, decision.dtype) if stats else ""
    out.audit = f"audit: {audit.line}" if audit else ""
    checked = diagnosis.forecast if diagnosis else None
    out.forecast = [f"FP16 forecast: {checked.forecast}", str(checked.line)] if checked else []
    out.gain = gain
    if not accepted:
        out.commands = _commands(variant, diagnosis)
    for note in decision.notes:  # e.g. the trial ran with other threads than the reference: said beside the verdict
        out.warnings.append(str(note))
    if loosened:
        out.warnings.append(
            f"the rule was loosened since this reference was rolled back for {variant}: {'; '.join(loosened)}"
            + (" - this accept may exist only because of it" if accepted else "")
        )
    return out


def _gain(bench: Measured | None) -> str:
    """The benchmark in words, as its speed verdict says (never a bare ratio), on the machine that measured it (its
    record's env: the figures may have been committed from another machine); a slower AMP is said plainly, beside a
    green accept."""
    if bench is None:
        return "not benchmarked yet"
    if not bench.benchmarked:
        return f"not benchmarked ({bench.reason})"
    words = speed_words(bench)
    if words is None:
        return "speed not measured"
    where = _machine(bench.env)
    w = bench.memory.working_memory_ratio.median if bench.memory.working_memory_ratio else None
    memory = f", working memory x{w:.2f}" if isinstance(w, (int, float)) and math.isfinite(w) else ""
    judged = bench.speed.verdict if bench.speed else None
    quality = bench.speed.to_quality if bench.speed else None
    to_quality = quality.verdict if quality else None
    if to_quality == "never reached" and not (quality.fp32_replicates and None not in quality.fp32_replicates):
        to_quality = "no measurable difference"  # FP32 itself, trained again, did not always get there either
    if judged == "faster" and to_quality in ("slower", "never reached"):  # a faster step that needs more of them
        return f"{words} on {where}{memory}: faster per step, not to FP32's final loss: keep FP32 there"
    if judged == "faster" and to_quality == "no measurable difference":
        return f"{words} on {where}{memory}: faster per step, no measurable gain to FP32's final loss"
    if judged == "faster":
        return f"{words} on {where}{memory}: switch to AMP there"
    if judged == "slower":
        if memory and w < 0.9:
            return f"{words} on {where}{memory}: keep FP32 there unless memory is what you lack"
        return f"{words} on {where}: keep FP32 there"
    if judged == "no measurable difference":
        return f"{words} on {where}{memory}: AMP gains nothing there but memory"
    return f"{words}{memory}"


def _machine(env: Mapping[str, Any]) -> str:
    """The machine a record was measured on, from its env (``devices.Environment``): its device name, else ``CPU`` or
    ``GPU`` by backend, with its capability where given (``NVIDIA H100 80GB HBM3 (GPU, capability 9.0)``,
    ``AMD EPYC 7B13 (CPU, AVX512)``). Never "this CPU": benchmark.json may come from another machine."""
    kind = "CPU" if env.get("backend", "cpu") == "cpu" else "GPU"
    name = printable(env.get("device_name") or "").strip()
    cap = printable(env.get("capability") or "").strip()
    if cap in ("", "unknown"):
        return f"{name} ({kind})" if name else f"the benchmark's {kind}"
    cap = cap if kind == "CPU" else f"capability {cap}"
    return f"{name} ({kind}, {cap})" if name else f"the benchmark's {kind} ({cap})"


def speed_words(bench: Measured | Mapping[str, Any]) -> str | None:
    """The benchmark's speed verdict with its figures: ``no measurable difference (x1.03, 95 % interval
    0.91-1.12; FP32 against itself 0.93-1.08)``, ``x1.50 faster (95 % interval ...)``, ``x0.32 (3.1 times slower;
    95 % interval ...)``. A record without a verdict (older than the A/A arm) is not judged; None without a speedup.
    ``bench`` may also be ``benchmark.json`` as read, holding its ``speed`` section at least.

    The one wording: ``pipeline.artifacts.benchmark.Speed.words`` (the stage's own line) says it through ``speed_line``."""
    if isinstance(bench, Mapping):  # benchmark.json as read (test_benchmark compares it with the record's own words)
        return speed_line(_Json(bench["speed"]))
    if not bench.benchmarked:
        return None
    median = bench.speedup.median if bench.speedup else None
    if bench.speed is None:
        if not isinstance(median, (int, float)) or not math.isfinite(median):
            return None
        rerun = f"`dvc repro -f benchmark@{bench.variant}`" if bench.variant else "the benchmark"
        return f"speed not judged (x{median:.2f}; no interval recorded: rerun {rerun})"
    return speed_line(bench.speed)


class _Json:
    """A JSON object read by attribute, as its record reads it (an absent key is None, as a record's ``ABSENT`` field):
    ``speed_words`` of the file without importing the benchmark's module, which imports this one."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        value = self._raw.get(name)
        return _Json(value) if isinstance(value, Mapping) else value


def speed_line(speed: Speed) -> str:
    """The verdict on the time per step with its figures, then the time to FP32's final loss where it was measured."""
    per_step = per_step_words(speed)
    return per_step if speed.to_quality is None else f"{per_step}; {to_quality_words(speed.to_quality)}"


def per_step_words(speed: Speed) -> str:
    """The verdict on the time per step with its figures (the benchmark's ``speed``), without the time to quality."""
    s, aa = speed.speedup, speed.fp32_again
    low, high, aa_low, aa_high = (float(x) for x in (s.low, s.high, aa.low, aa.high))
    level = f"{100 * float(s.level):.0f} %"
    if math.isinf(high) or math.isinf(aa_high):
        figures = f"{s.n} rounds are too few for a {level} interval; raise bench.repeats"
    else:
        figures = f"{level} interval {low:.2f}-{high:.2f}; FP32 against itself {aa_low:.2f}-{aa_high:.2f}"
    m = float(s.median)
    if speed.verdict == "faster":
        return f"x{m:.2f} faster ({figures})"
    if speed.verdict == "slower":
        return f"x{m:.2f} ({1 / m:.1f} times slower; {figures})"
    return f"no measurable difference (x{m:.2f}, {figures})"


def to_quality_words(q: TimeToQuality) -> str:
    """AMP's time to FP32's final loss (the benchmark's ``speed.to_quality``), as
    ``pipeline.artifacts.benchmark.TimeToQuality.words`` says it."""
    reps = list(q.fp32_replicates)
    if not reps:
        others = ""
    elif len(reps) > 1 and None not in reps:
        others = f"; FP32's replicates {min(reps)}-{max(reps)}"
    else:
        others = "; FP32's replicates " + ", ".join("never" if r is None else str(r) for r in reps)
    fp32 = "never" if q.fp32 is None else q.fp32
    if q.amp is None:
        return f"never reached FP32's final loss in {q.of} updates (FP32 {fp32}{others}): no time-to-quality claim"
    if q.ratio is None:
        return f"time to FP32's final loss not judged (AMP needed {q.amp} of {q.of} updates, FP32 {fp32}{others})"
    ratio, low, high = (float(x) for x in (q.ratio, q.low, q.high))
    return (f"time to FP32's final loss: x{ratio:.2f} ({low:.2f}-{high:.2f}; AMP needed {q.amp} of {q.of} updates, "
            f"FP32 {fp32}{others})")


def _unsupported(audit: Audit, bench: Measured | None) -> str:
    """A speedup measured on a variant whose reduced-precision work is negligible comes from something else."""
    share = audit.total.reduced_share or 0.0
    words = speed_words(bench) if bench is not None and bench.benchmarked else None
    measured = f"; the benchmark measured {words}" if words else ""
    return f"speedup claim unsupported: autocast barely engaged (share {100 * share:.1f} %){measured}"


def _flips(flips: Decisions, decision: Decision) -> list[str]:
    """Flipped cases, real samples first. A real sample whose reference margin is under ``boundary_margin`` (the head's,
    else the rule's) is said to be one (compare counts it as "near the boundary", apart from the constructed boundary
    cases)."""
    listed = flips.flip_list
    margin = flips.boundary_margin
    if margin is None and any(f.near_boundary for f in listed):
        margin = decision.acceptance().boundary_margin
    order = sorted(listed, key=lambda f: (f.kind == "boundary", not f.near_boundary, str(f.id),
                                          -1 if f.position is None else f.position))
    lines = []
    for f in order[:MAX_FLIPS]:
        where = safe_id(f.id) if f.position is None else f"{safe_id(f.id)}@{f.position}"
        if f.reference_class is not None:
            text = (
                f"{where}: class {f.reference_class} -> {f.trial_class}, reference margin "
                f"{_g(f.reference_margin)} (trial {_g(f.trial_margin)})"
            )
        else:
            text = f"{where}: {_g(f.reference)} -> {_g(f.trial)} across the threshold"
        if f.kind == "boundary":
            text += " - a constructed boundary case"
        elif f.near_boundary:
            text += (
                f" - a REAL sample near the boundary (its margin is under boundary_margin {_g(margin)}): "
                "it counts as a near-boundary flip"
            )
        else:
            text += " - a REAL sample with a clear margin"
        lines.append(text)
    total = len(listed) + flips.flip_list_dropped
    if total > MAX_FLIPS:
        lines.append(f"... and {total - MAX_FLIPS} more (compare's stats.json flip_list and cases.json)")
    return lines


def _training(stats: Stats, dtype: str) -> str:
    t = stats.training
    if not t.steps:
        return "training: not judged (reference.train_steps 0: an inference-only verdict)"
    if t.noise is not None:  # against FP32's own spread: the replicates' gap to the reference, where training ended
        drift = f"mean gap {_g(t.noise.mean_amp_gap)} vs FP32's own {_g(t.noise.mean_replicate_gap)}"
        if t.final is not None:
            drift += f", ends at {_g(t.final.amp)} (FP32 runs {', '.join(_g(v) for v in t.final.fp32)})"
    else:
        drift = "stayed inside its band" if not t.band_violations else f"left its band at {t.band_violations} step(s)"
    scaler = (
        "no GradScaler (bfloat16 keeps FP32's exponent range: the loss scale stays 1 by design)"
        if dtype == "bfloat16"
        else f"final loss scale {_g(t.final_scale)}, {_g(100 * t.skipped_fraction)}% of steps skipped"
        + (f" after {t.calibration_steps} calibration skip(s)" if t.calibration_steps else "")
    )
    return f"training: worst loss gap {_g(t.max_loss_gap)}, {drift}; {scaler}"


def _commands(variant: str, diagnosis: Diagnosis | None) -> list[str]:
    """The next commands after a rollback, the useful one first: the diagnosis' suggested experiment where it has one
    (publish's last line and the MLflow headline quote the first alone), then restoring the FP32 reference state."""
    cmds = []
    s = diagnosis.suggestion if diagnosis else None
    if s is not None and s.fp32_modules:
        modules = json.dumps(list(s.fp32_modules), separators=(",", ":"))  # quoted: module '5' stays a string
        checked = "passes the rule in a re-run" if s.rule_passes else "not checked by a re-run"
        cmds.append(
            f"dvc exp run -S 'trial.policies.{variant}.fp32_modules={modules}' -S 'trial.variants=[{variant}]'"
            f"   # suggested FP32 regions ({checked})"
        )
    cmds.append(f"python -m pipeline restore --variant {variant}   # verified FP32 reference state -> restored/")
    return cmds


def _g(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


# --- renderings ------------------------------------------------------------------------------------------


def text(v: Verdict) -> str:
    """Plain text for a terminal: the sentence, then indented details (every piece printable: an id with a
    newline or an ANSI escape cannot forge a line or reach the terminal)."""
    v = replace(v, **{k: _printable_all(getattr(v, k)) for k in ("sentence", "reasons", "flips", "training", "audit", "forecast",
                                                                   "warnings")})
    lines = [v.sentence]
    lines += [f"  ! {w}" for w in v.warnings]
    lines += [f"  - {r}" for r in v.reasons]
    if v.flips:
        lines.append(f"  flipped cases ({_count(v.flips)}):")
        lines += [f"    {f}" for f in v.flips]
    lines += [f"  {d}" for d in v.details]
    if v.commands:
        lines.append("  next:")
        lines += [f"    {c}" for c in v.commands]
    return "\n".join(lines)


def markdown(verdicts: Sequence[Verdict]) -> str:
    """The block as Markdown: a heading per variant, the sentence in bold, details as lists, commands in code."""
    out = ["## Verdict", ""]
    for v in verdicts:
        out += [f"**{_md(v.sentence)}**", ""]
        out += [f"- :warning: {_md(w)}" for w in v.warnings]
        out += [f"- {_md(r)}" for r in v.reasons]
        out += [f"- {_md(d)}" for d in v.details]
        if v.flips:
            out.append(f"- flipped cases ({_count(v.flips)}):")
            out += [f"    - {_md(f)}" for f in v.flips]
        if v.commands:
            out += ["", "Next:", "", "```", *v.commands, "```"]
        out.append("")
    return "\n".join(out)


def html(verdicts: Sequence[Verdict]) -> str:
    """The block as an HTML fragment (``<section id="verdict">``), first on the report page."""
    e = _html.escape
    parts = ['<section id="verdict"><h2>Verdict</h2>']
    for v in verdicts:
        head = f"{v.variant}: {v.decision.upper()}"
        rest = v.sentence[len(head):] if v.sentence.startswith(head) else ""
        sentence = f'<span class="{e(v.decision)}">{e(head)}</span>{e(rest)}' if rest else e(v.sentence)
        parts.append(
            f'<div class="verdict v-{e(v.decision)}" data-variant="{e(v.variant)}"><p class="sentence">{sentence}</p><ul>'
        )
        parts += [f'<li class="warning">{e(w)}</li>' for w in v.warnings]
        parts += [f"<li>{e(r)}</li>" for r in v.reasons]
        parts += [f"<li>{e(d)}</li>" for d in v.details]
        if v.flips:
            parts.append(
                f"<li>flipped cases ({_count(v.flips)}):<ul>" + "".join(f"<li>{e(f)}</li>" for f in v.flips) + "</ul></li>"
            )
        parts.append("</ul>")
        if v.commands:
            parts.append("<p>Next:</p><pre>" + e("\n".join(v.commands)) + "</pre>")
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


def headline(verdicts: Sequence[Verdict]) -> str:
    """One Markdown line per variant, for the few lines MLflow shows of a description before "Show more"."""
    lines = []
    for v in verdicts:
        head = f"{v.variant}: {v.decision.upper()}"
        rest = v.sentence[len(head):].lstrip(": ") if v.sentence.startswith(head) else v.sentence
        line = f"**{head}** - {_md(rest)}"
        if v.commands:
            line += f"; next: `{v.commands[0].split('   # ')[0].strip()}`"
        if v.warnings:
            line += " (:warning: rule loosened since a rollback)"
        lines.append(line)
    return "  \n".join(lines) + "\n"


def one_line(verdicts: Sequence[Verdict]) -> str:
    """Every variant's decision and gain on one line (publish's last line)."""
    def detail(v: Verdict) -> str:
        if v.decision == "accept":
            return f" ({v.gain})" if v.gain else ""
        return f" ({v.failed}; next: {v.commands[0].split('   # ')[0].strip()})" if v.commands else f" ({v.failed})"

    return printable("; ".join(f"{v.variant} {v.decision.upper()}{detail(v)}" for v in verdicts))


def _count(flips: Sequence[str]) -> str:
    more = [f for f in flips if f.startswith("... and ")]
    if not more:
        return str(len(flips))
    return str(len(flips) - 1 + int(more[0].split()[2]))


MAX_ID = 120
"""Characters of a case id shown in a verdict; the whole id is in compare's cases.json."""


def printable(s: str) -> str:
    """``s`` with every non-printable character escaped as Python writes it (``\\n``, ``\\x1b``, ``\\u202e``)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(s))


def safe_id(value: Any) -> str:
    """A case id as a verdict shows it: printable, at most ``MAX_ID`` characters."""
    s = printable(value)
    return s if len(s) <= MAX_ID else f"{s[:MAX_ID]}…(+{len(s) - MAX_ID} chars)"


def _printable_all(value: Any) -> Any:
    return [printable(x) for x in value] if isinstance(value, list) else printable(value)


_MD_ESCAPES = {"\\": "\\\\", "|": "\\|", "*": "\\*", "_": "\\_", "[": "\\[", "]": "\\]", "`": "\\`", "<": "&lt;"}


def _md(s: str) -> str:
    """Text as Markdown shows it literally (MLflow descriptions): table pipes, emphasis, link brackets, code
    spans and raw HTML (``<``) escaped, every non-printable character written out."""
    return "".join(_MD_ESCAPES.get(c, c) for c in printable(s))
