"""Output roles, in one home: what each output the model returns *is*, and so how compare judges it.

| role | shapes | how it is judged |
|---|---|---|
| ``classes`` | [N, C] or per token [N, T, C], C >= 2 | argmax over its last axis: flips, ties, margins; values too |
| ``positions`` | [N, T], beside a primary so read | argmax over the batch's real positions (an answer's start or end) |
| ``labels`` | [N], [N, L], per token [N, T, 1] | each value on its own at a threshold (a logit at 0, a probability at 0.5) |
| ``values`` | any | its values alone, within atol + rtol·abs(reference) |
| ``ignored`` | any but the primary | not judged |

A role is stated (``acceptance.outputs.NAME.role``, hashed with the rule and never second-guessed) or inferred here, from
the task's kind, the output's shape, its targets and its name. Nothing else in the project reads an output's name: the
patterns below are the only ones. freeze resolves the table once (``resolve``), prints it and records it in the
reference's manifest; compare, diagnose, decide and the report read it from there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from pipeline.artifacts.record import Record

if TYPE_CHECKING:
    from pipeline.config import AcceptanceConfig, Tolerance


ROLES = ("classes", "positions", "labels", "values", "ignored")
"""Every role an output can have (module docstring)."""
DECIDED = ("classes", "positions", "labels")
"""The roles whose decisions are judged."""

FEATURE_NAMES = re.compile(r"(^|_)(hidden|embed\w*|features?|states?|pooler\w*|pooled|attentions?|attn|latents?|"
                           r"representations?|boxes|bbox\w*|coord\w*|depths?|offsets?)(_|$)", re.IGNORECASE)
"""Output names that say features or coordinates, values and not decisions (Hugging Face's ``last_hidden_state``,
``pooler_output``, ``hidden_states``, an ``embedding``, DETR's ``pred_boxes``), unless they end like scores
(``DECISION_NAMES``)."""
DECISION_NAMES = re.compile(r"(logits?|scores?|probs?|probas?|probabilit(y|ies)|class(es)?|labels?|preds?|predictions?)$",
                            re.IGNORECASE)
"""Output names that say decisions whatever else they hold (``dialog_state_logits``, ``attention_scores``)."""
CLASS_NAMES = re.compile(r"(logits?|probs?|probas?|probabilit(y|ies)|class(es)?)$", re.IGNORECASE)
"""Output names that say class scores beside a regression's values (where a ``pred`` or a ``score`` may be a value)."""
PROBABILITY_NAMES = re.compile(r"(probs?|probas?|probabilit(y|ies))$", re.IGNORECASE)
"""Output names that say probabilities: a single-value head so named is decided at 0.5."""
LOGIT_NAMES = re.compile(r"logits?$", re.IGNORECASE)
"""Output names that say logits: a single-value head so named is decided at 0, whatever range its values span."""
POSITION_NAMES = re.compile(r"(^|_)(start|end)(_|$)", re.IGNORECASE)
"""Output names that say scores over positions, an answer span's ends (Hugging Face's QA heads: ``start_logits``,
``end_logits``): only such a head, or one stated ``positions``, is read over the real positions."""
STATES = re.compile(r"(^|_)(hidden_states?|attentions?)$|^(intermediate|enc|init)_")
"""Tensor fields of a Hugging Face ``ModelOutput`` that hold the model's inner states, not its predictions
(``last_hidden_state``, ``encoder_last_hidden_state``; RT-DETR's and Deformable DETR's ``intermediate_logits``,
``enc_topk_logits``, ``init_reference_points``): left out where the output has a head (a field named like scores); a
base model's (``BertModel``, no head) are its outputs and are kept."""

DEFAULT_OUTPUT = "output"
"""The name of an output the model returns as a bare tensor."""


def says_probability(name: str) -> bool:
    return bool(PROBABILITY_NAMES.search(name))


def says_logit(name: str) -> bool:
    return bool(LOGIT_NAMES.search(name))


def says_features(name: str) -> bool:
    return bool(FEATURE_NAMES.search(name))


def inner_states(fields: dict) -> dict:
    """A ``ModelOutput``'s tensor fields less its inner states (``STATES``), where one field says a head."""
    if any(DECISION_NAMES.search(k) for k in fields):
        return {k: v for k, v in fields.items() if not STATES.search(k)}
    return fields


def primary_name(names: Iterable[str]) -> str:
    """The output decisions and the loss are computed from: ``output``, ``logits``, else the first by name that ends
    like scores (``DECISION_NAMES``), else the first that does not say features (CLIP's ``logits_per_image``, not
    its ``image_embeds``), else the first."""
    names = sorted(names)
    named = [n for n in (DEFAULT_OUTPUT, "logits") if n in names]
    scores = [n for n in names if DECISION_NAMES.search(n)]
    values = [n for n in names if not FEATURE_NAMES.search(n)]
    return next(iter(named + scores + values + names), DEFAULT_OUTPUT)


def primary_by_order(names: Iterable[str]) -> list[str]:
    """The outputs the primary is picked among by alphabetical order alone (``primary_name``: none is ``output`` or
    ``logits`` or ends like scores, and several do not say features), else []: a regression's ``{mean, log_var}`` would
    have its quality and loss read from ``log_var``."""
    names = sorted(names)
    if any(n in (DEFAULT_OUTPUT, "logits") or DECISION_NAMES.search(n) for n in names) or all(n.isdigit() for n in names):
        return []  # a tuple's outputs, named by position: its first is the primary, as a model returns it
    values = [n for n in names if not FEATURE_NAMES.search(n)] or names
    return values if len(values) > 1 else []


def decides(tol: Tolerance, name: str, kind: str = "classification") -> bool:
    """Whether output ``name`` of a ``kind`` task, if shaped like class scores or one logit, is decided under entry
    ``tol``: its stated role; else ``decisions``; else, in a classification, unless its name says features
    (``FEATURE_NAMES``, unless it ends like scores), and in a regression, where named like class scores."""
    if tol.role is not None:
        return tol.role in DECIDED
    if tol.decisions is None and kind == "classification":
        return bool(DECISION_NAMES.search(name)) or not FEATURE_NAMES.search(name)
    return scored(tol, name, kind)


def scored(tol: Tolerance, name: str, kind: str = "classification") -> bool:
    """Whether output ``name`` says it holds decisions: a decided role or ``decisions: true``, or, with nothing said,
    named like scores (``DECISION_NAMES``; in a regression task, like class scores: ``CLASS_NAMES``)."""
    if tol.role is not None:
        return tol.role in DECIDED
    if tol.decisions is not None:
        return tol.decisions
    return bool((DECISION_NAMES if kind == "classification" else CLASS_NAMES).search(name))


def judged(rule: AcceptanceConfig, names: Iterable[str]) -> list[str]:
    """The outputs among ``names`` that are judged: all but those stated ``ignored``."""
    return [n for n in names if rule.tolerance(n).role != "ignored"]


def decision_threshold(rule: AcceptanceConfig, kind: str, primary: str, labels: bool, fitted: bool = False,
                       width: int = 1, loss: str = "") -> float | None:
    """The value a regression's primary output is decided at, each of its values on its own: its entry's or the rule's
    ``threshold``; else, where the primary holds a sigmoid's decisions, 0.5 for a probability, 0 for a logit: stated
    ``labels`` or ``decisions: true``, or named like class scores with targets that are ``labels``, 0 or 1
    (Hugging Face's regression head is named ``logits`` too, and its values crossing 0 are no decision), or several
    values per case on 0/1 labels under the model's own loss (``loss: model``: Hugging Face's multi-label head, BCE on
    logits); a value the loss ``fitted`` to the targets (MSE on 0/1 labels) at 0.5, the labels' midpoint, whatever its
    name; else None, values only. A classification's primary is decided by argmax: None."""
    if kind == "classification":
        return None
    tol = rule.tolerance(primary)
    if tol.role == "values":
        return None
    if tol.threshold is not None:
        return tol.threshold
    if rule.threshold is not None:
        return rule.threshold
    said = tol.role == "labels" or tol.decisions
    multi_label = tol.role is None and tol.decisions is None and labels and width > 1 and loss == "model"
    if not (said or multi_label or tol.decisions is None and tol.role is None and labels and scored(tol, primary, kind)):
        return None
    return 0.5 if fitted or says_probability(primary) else 0.0


def decided_heads(kind: str, rule: AcceptanceConfig, shapes: dict[str, tuple[int, ...]], main: str) -> list[str]:
    """Outputs whose decisions are taken by argmax (roles ``classes`` and ``positions``): the primary of a
    classification task, and every other output shaped like class scores, per case [N, C >= 2] or per token
    [N, T, C >= 2] (an untested head is no accept, in a regression task too), that its entry decides (``decides``),
    unless stated ``labels``."""
    return [name for name, shape in sorted(shapes.items())
            if (name == main and kind == "classification")
            or (name != main and len(shape) in (2, 3) and shape[-1] >= 2 and decides(rule.tolerance(name), name, kind)
                and rule.tolerance(name).role != "labels")]


def score_heads(kind: str, rule: AcceptanceConfig, shapes: dict[str, tuple[int, ...]], main: str) -> list[str]:
    """The argmax heads (``decided_heads``) whose values are known to be read through softmax alone: the primary of a
    classification task, and a head that says it holds scores (``scored``). A pair of their scores at probability 0 on
    both sides agrees (``gaps.GapStats(scores_only=)``). A head decided only because nothing names it features keeps
    every finite value judged by its tolerance: a measurement [N, 3] of values 300, 5 and 2 beside a classifier is
    decided by argmax, yet its two small columns, more than 104 below the first, are values a user reads."""
    return [name for name in decided_heads(kind, rule, shapes, main)
            if (name == main and kind == "classification") or scored(rule.tolerance(name), name, kind)]


def sign_heads(kind: str, rule: AcceptanceConfig, shapes: dict[str, tuple[int, ...]], main: str) -> list[str]:
    """Heads other than the primary decided value by value at a threshold (role ``labels``): single-value heads ([N],
    [N, 1], per token [N, T, 1]: a sigmoid's, decided by logit >= 0) that their entry decides, and a multi-label head
    [N, L] stated ``labels``: each decision flips where its value crosses the threshold."""
    out = []
    for name, shape in sorted(shapes.items()):
        tol = rule.tolerance(name)
        single = math.prod(shape[1:]) == 1 or len(shape) == 3 and shape[-1] == 1
        if name != main and (single and decides(tol, name, kind) or tol.role == "labels" and len(shape) == 2):
            out.append(name)
    return out


def position_names(kind: str, rule: AcceptanceConfig, shapes: dict[str, tuple[int, ...]], main: str) -> list[str]:
    """The argmax heads read over the batch's positions, where the primary is (``streams.position_heads`` adds the real
    positions, or finds none): stated ``positions``, or, with no role stated, named like an answer's ends
    (``POSITION_NAMES``: an extractive QA model's ``start_logits`` and ``end_logits``), of the primary's shape.
    The name is part of the signal: a classifier of C classes over sequences padded to T = C, whose few padded cases'
    labels happen to lie within their lengths, has the very shapes and targets of a QA head; read over positions, its
    classes past a short case's length would be -inf, and a trial moving that case there no flip (a false accept)."""
    def says(name: str) -> bool:
        role = rule.tolerance(name).role
        return role == "positions" or role is None and bool(POSITION_NAMES.search(name))

    if kind != "classification" or not says(main):
        return []
    return [name for name in decided_heads(kind, rule, shapes, main) if shapes[name] == shapes[main] and says(name)]


def role_problem(kind: str, rule: AcceptanceConfig, shapes: dict[str, tuple[int, ...]], main: str,
                 read_over_positions: Iterable[str]) -> str | None:
    """A stated role this output cannot have, as one line naming the output and the fix, or None. Its shapes are the
    reference's, past nothing (``shapes[name][0]`` is the rows)."""
    over = set(read_over_positions)
    for name in sorted(shapes):
        tol = rule.tolerance(name)
        role, shape, key = tol.role, shapes[name], f"acceptance.outputs.{name}"
        if role is None:
            continue
        fix = f"state another role for '{name}' or none"
        if name == main and role == "ignored":
            return f"params.yaml: {key}.role is ignored, but '{name}' is the primary output (quality and the loss read it); {fix}"
        if name == main and kind == "classification" and role not in ("classes", "positions"):
            return (f"params.yaml: {key}.role is {role}, but a classification's primary is decided by argmax; state classes "
                    f"or positions, or set task.kind: regression")
        if name == main and kind == "regression" and role in ("classes", "positions"):
            return (f"params.yaml: {key}.role is {role}, but a regression's primary is decided value by value; state "
                    f"labels (at a threshold) or values, or set task.kind: classification")
        if role in ("classes", "positions") and not (len(shape) in (2, 3) and shape[-1] >= 2):
            return (f"params.yaml: {key}.role is {role}, but '{name}' has shape {list(shape)}, not class scores [N, C] or "
                    f"[N, T, C] with C >= 2; {fix}")
        if role == "positions" and name not in over:
            return (f"params.yaml: {key}.role is positions, but '{name}' is not read over the batch's real positions: "
                    f"the primary must be too (stated positions, of the same shape) and the targets index positions; {fix}")
        if role == "labels" and name != main and len(shape) == 3 and shape[-1] != 1:
            return (f"params.yaml: {key}.role is labels, but '{name}' has shape {list(shape)}: per token, one label [N, T, 1] "
                    f"is decided, not {shape[-1]}; {fix}")
        if tol.threshold is not None and role != "labels":
            return f"params.yaml: {key}.threshold is set but its role is {role}; a threshold decides role labels only"
        if name == main and tol.threshold is not None and rule.threshold is not None and tol.threshold != rule.threshold:
            return (f"params.yaml: {key}.threshold {tol.threshold:g} and acceptance.threshold {rule.threshold:g} both decide "
                    f"the primary '{name}'; keep one of them")
        if role == "values" and name == main and rule.threshold is not None:
            return (f"params.yaml: acceptance.threshold decides the primary '{name}', but {key}.role is values; drop one "
                    f"of them")
    return None


@dataclass(frozen=True)
class Head(Record):
    """One line of the role table: how compare judges one output."""

    name: str
    shape: tuple[int, ...]
    """Past the rows."""
    role: str
    decided: str
    """How its decisions are taken (``argmax over classes``, ``each value at 0``...), or ``-``."""
    stated: bool
    """The role came from ``acceptance.outputs.NAME.role``; else it was inferred here."""
    atol: float
    rtol: float
    scale: float | None = None
    """The reference's RMS over the fixed set (its magnitude, against which atol reads), where known."""
    primary: bool = False
    mask: str = "-"
    """What positions are left out: ``padding`` (attention mask), ``-100 targets``, ``real positions``, ``-``."""
    softmax_only: bool = False
    """Its values are read through softmax alone (``score_heads``): scores at probability 0 on both sides agree."""


@dataclass(frozen=True)
class Roles(Record):
    """The role table of one reference (in its manifest): what compare reads instead of inferring again."""

    heads: tuple[Head, ...]
    threshold: float | None = None
    """A regression primary's decision threshold (``decision_threshold``), None: values only or a classification."""
    undecided: tuple[str, ...] = ()
    """Outputs judged by values alone though their targets are labels 0 or 1 (a regression primary no role, name or loss
    says decided): the verdict says that no decision was judged for them, and how to state one."""

    @classmethod
    def read(cls, recorded: dict | None) -> Roles | None:
        """The table a manifest recorded, or None where it recorded none."""
        return cls.from_dict(recorded) if recorded else None

    def of(self, *roles: str) -> list[str]:
        return [h.name for h in self.heads if h.role in roles]

    def judged_as(self) -> tuple[list[str], list[str], list[str], list[str]]:
        """What compare reads: the argmax heads, those read through softmax alone, the label heads beside the primary,
        and the heads read over real positions (``decided_heads``, ``score_heads``, ``sign_heads``, ``position_names``)."""
        return (self.of("classes", "positions"), [h.name for h in self.heads if h.softmax_only],
                [h.name for h in self.heads if h.role == "labels" and not h.primary], self.of("positions"))

    def lines(self) -> list[str]:
        """The table as printed by freeze: one line per output."""
        rows = [("name", "shape", "role", "decided", "atol", "rtol", "scale", "mask")]
        for h in self.heads:
            rows.append((h.name + " (primary)" * h.primary, "x".join(map(str, h.shape)) or "1",
                         f"{h.role} ({'stated' if h.stated else 'inferred'})", h.decided, f"{h.atol:g}", f"{h.rtol:g}",
                         "-" if h.scale is None else f"{h.scale:.3g}", h.mask))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def resolve(kind: str, rule: AcceptanceConfig, shapes: dict[str, tuple[int, ...]], main: str, *,
            threshold: float | None, over_positions: Iterable[str], probabilities: dict[str, bool],
            scales: dict[str, float] | None = None, per_token: bool = False, token_mask: bool = False,
            labels: bool = False) -> Roles:
    """The role table of outputs ``shapes`` (each [N, ...]) under ``rule``, as compare judges them: ``threshold``, the
    primary's (``decision_threshold``); ``over_positions``, the heads read over real positions (``position_names``, where
    real positions were found); ``probabilities``, per ``sign_heads`` head, whether it holds probabilities (decided at
    0.5, ``decisions.holds_probabilities``); ``labels``: the primary's targets are labels 0 or 1."""
    over = set(over_positions)
    argmax = set(decided_heads(kind, rule, shapes, main))
    signs = set(sign_heads(kind, rule, shapes, main))
    softmax_only = set(score_heads(kind, rule, shapes, main))
    heads = []
    for name in sorted(shapes):
        tol = rule.tolerance(name)
        shape = tuple(shapes[name][1:])
        if tol.role == "ignored":
            role, decided = "ignored", "-"
        elif name in over:
            role, decided = "positions", "argmax over real positions"
        elif name in argmax:
            role, decided = "classes", "argmax over classes"
        elif name in signs:
            at = tol.threshold if tol.threshold is not None else 0.5 if probabilities.get(name) else 0.0
            role, decided = "labels", f"each value at {at:g}"
        elif name == main and threshold is not None:
            role, decided = "labels", f"each value at {threshold:g}"
        else:
            role, decided = "values", "-"
        mask = "-"
        if name in over:
            mask = "real positions"
        elif len(shapes[name]) >= 2 and token_mask and per_token:
            mask = "padding"
        if name == main and per_token:
            mask = "padding, -100 targets" if token_mask else "-100 targets"
        heads.append(Head(name=name, shape=shape, role=role, decided=decided, stated=tol.role is not None,
                          atol=tol.atol, rtol=tol.rtol, scale=(scales or {}).get(name), primary=name == main, mask=mask,
                          softmax_only=name in softmax_only))
    undecided = tuple(h.name for h in heads if h.primary and h.role == "values" and not h.stated and labels)
    return Roles(heads=tuple(heads), threshold=threshold, undecided=undecided)
