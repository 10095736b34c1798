"""The typed configuration: params.yaml is read and validated here, once.

Every knob of the pipeline is a field below. Loading rejects unknown keys, wrong types and impossible
values with one line that names the key (``acceptance.outputs.logits.atol``) and says what to write
instead. Stages receive the ``Params`` object and never read params.yaml themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline import heads
from pipeline.errors import UserError

DTYPES = ("float16", "bfloat16")
_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class TaskConfig:
    kind: Literal["classification", "regression"] = "classification"
    """How outputs turn into decisions: argmax (classification, per sample [N, C] or per token [N, T, C])
    or error and threshold (regression)."""
    model: str = "pipeline.examples.digits:build_model"
    """``module:function`` returning a ``torch.nn.Module``; called with ``options``."""
    data: str = "pipeline.examples.digits:load_data"
    """``module:function`` returning train_x, train_y, eval_x, eval_y (and optional eval_ids, edge_x, edge_ids).
    Inputs are a tensor or a dict of tensors sharing dim 0 (dtypes kept); train_x may be a map-style Dataset."""
    options: dict = field(default_factory=dict)
    """Keyword arguments given to both functions: at most ``MAX_FREE_FORM_VALUES`` values once YAML aliases are
    expanded, nested at most ``MAX_FREE_FORM_DEPTH`` deep (an alias bomb, or an alias that holds itself, is refused)."""
    loss: str = "cross_entropy"
    """Training loss: ``cross_entropy`` (classification; targets of -100 ignored), ``mse`` (regression),
    ``model`` (the model's own ``.loss``, targets passed under ``label_key``) or ``module:function``
    called as ``f(output, target)``. Always computed in float32 or wider."""
    label_key: str = "labels"
    """Keyword under which targets reach the model when ``loss: model`` (Hugging Face style), and the
    key of the target in a training Dataset item that is a dict."""
    metric: str = "auto"
    """Quality on the ordinary cases: ``accuracy``, ``top_k``, ``neg_rmse``, ``neg_mae`` or ``module:function``
    (``f(output, target) -> float``), ``label_accuracy`` (a regression decided at a threshold: the fraction of values on
    their target's side); ``auto`` is accuracy for classification, neg_rmse for regression, label_accuracy for a regression
    whose primary is decided at a threshold on targets that are labels, 0 or 1 (multi-label, one logit)."""
    metric_direction: Literal["auto", "higher", "lower"] = "auto"
    """Whether a larger metric is better; built-in metrics know theirs (higher), a ``module:function`` says it."""
    top_k: int = 5
    """k of the ``top_k`` metric."""

    def check(self, key: str) -> None:
        for name in ("model", "data"):
            value = getattr(self, name)
            if not _ENTRY_POINT.match(value):
                raise UserError(
                    f"params.yaml: {key}.{name} is {value!r}; write it as 'module:function', "
                    f"for example 'pipeline.examples.digits:build_model'"
                )
        if self.loss not in LOSSES and not _ENTRY_POINT.match(self.loss):
            raise UserError(f"params.yaml: {key}.loss is {self.loss!r}; use one of {', '.join(LOSSES)} or 'module:function'")
        wanted = {"cross_entropy": "classification", "mse": "regression"}.get(self.loss)
        if wanted is not None and wanted != self.kind:
            expected = "cross_entropy" if self.kind == "classification" else "mse"
            raise UserError(
                f"params.yaml: {key}.loss is {self.loss!r} but task.kind is {self.kind!r}; "
                f"use loss: {expected}, model or 'module:function'"
            )
        if self.metric != "auto" and self.metric not in METRICS and not _ENTRY_POINT.match(self.metric):
            raise UserError(
                f"params.yaml: {key}.metric is {self.metric!r}; use auto, one of {', '.join(METRICS)} or 'module:function'"
            )
        name = self.metric_name
        if name in METRICS and METRICS[name][0] != self.kind:
            raise UserError(
                f"params.yaml: {key}.metric {name} is for {METRICS[name][0]} but task.kind is {self.kind!r}; use metric: auto"
            )
        if name not in METRICS and self.metric_direction == "auto":
            raise UserError(
                f"params.yaml: {key}.metric {name} is your own: "
                "say whether larger is better with metric_direction: higher or lower"
            )
        if name in METRICS and self.metric_direction == "lower":
            raise UserError(f"params.yaml: {key}.metric_direction is lower but {name} is larger-is-better; use auto")
        _positive(self.top_k, f"{key}.top_k")
        if not self.label_key.strip():
            raise UserError(
                f"params.yaml: {key}.label_key is empty; give the keyword your model takes its targets under, e.g. labels"
            )

    @property
    def metric_name(self) -> str:
        """The metric in effect: ``auto`` resolved by kind."""
        if self.metric != "auto":
            return self.metric
        return "accuracy" if self.kind == "classification" else "neg_rmse"

    def fits_values(self, width: int) -> bool:
        """Whether the loss fits the primary's values, ``width`` per case or position, to the targets: ``mse``, and under
        ``model`` Hugging Face's head of one value (``problem_type`` regression, MSE; several are multi-label logits,
        BCE). A value so fitted to 0/1 labels is decided at 0.5, a sigmoid's logit at 0."""
        return self.loss == "mse" or (self.loss == "model" and width == 1)

    @property
    def higher_is_better(self) -> bool:
        return self.metric_direction != "lower"

    @property
    def metric_range(self) -> tuple[float, float]:
        """Closed range of the metric's values (``metric_range``)."""
        return metric_range(self.metric_name)


LOSSES = ("cross_entropy", "mse", "model")
METRICS: dict[str, tuple[str, tuple[float, float]]] = {
    "accuracy": ("classification", (0.0, 1.0)),
    "top_k": ("classification", (0.0, 1.0)),
    "neg_rmse": ("regression", (-math.inf, 0.0)),
    "neg_mae": ("regression", (-math.inf, 0.0)),
    "label_accuracy": ("regression", (0.0, 1.0)),
}
"""Built-in metrics: the kind each fits and its range (all larger-is-better)."""


def metric_range(name: str) -> tuple[float, float]:
    """Closed range of metric ``name``'s values (infinite ends for a user metric)."""
    return METRICS[name][1] if name in METRICS else (-math.inf, math.inf)


@dataclass(frozen=True)
class PrepareConfig:
    ordinary_cases: int = 256
    """How many evaluation samples enter the fixed set, in the order the data function gives them (at most
    ``MAX_CASES``)."""
    edge_scales: list[float] = field(default_factory=lambda: [1.0e-4, 100.0])
    """Each ordinary sample chosen for edge cases is also scaled by each factor (extreme magnitudes)."""
    edge_samples: int = 4
    """How many ordinary samples are scaled for edge cases (at most ``MAX_CASES``)."""

    def check(self, key: str) -> None:
        _count(self.ordinary_cases, f"{key}.ordinary_cases", MAX_CASES, CASES_WHY, least=1)
        _count(self.edge_samples, f"{key}.edge_samples", MAX_CASES, CASES_WHY)
        for i, s in enumerate(self.edge_scales):
            _positive(s, f"{key}.edge_scales[{i}]")


MAX_CASES = 10**7
CASES_WHY = "every case is inferred and stored by freeze and each trial"
"""A bound on the cases of the fixed set: ten million is beyond any fixed set validated on one node."""


@dataclass(frozen=True)
class LrSchedule:
    kind: Literal["none", "step", "cosine", "linear"] = "none"
    """Multiplier of ``reference.lr`` as a function of REAL (not skipped) updates u, after ``warmup``:
    ``step`` gamma^((u - warmup) // every); ``cosine`` and ``linear`` decay to 0 at the last update."""
    every: int = 20
    """Real (not skipped) optimizer updates between two decays (``step``)."""
    gamma: float = 0.5
    """Decay factor, in (0, 1] (``step``)."""
    warmup: int = 0
    """Linear warmup from 0 over this many REAL updates (Hugging Face's convention), for every kind."""

    def check(self, key: str) -> None:
        _positive(self.every, f"{key}.every")
        _non_negative(self.warmup, f"{key}.warmup")
        if not 0 < self.gamma <= 1:
            raise UserError(f"params.yaml: {key}.gamma is {self.gamma}; use a factor in (0, 1]")


@dataclass(frozen=True)
class ReferenceConfig:
    train_steps: int = 60
    """Optimizer updates (steps) of the FP32 reference training (the trial repeats exactly these); each
    step consumes ``grad_accumulation`` micro-batches. At most ``MAX_MICRO_BATCHES`` micro-batches in all: their
    order is drawn, and each step recorded, before and while training, in memory. 0: an inference-only verdict (the
    model as built): freeze trains no reference and no replicate, trials train nothing, and the verdict's training part is
    "not judged"."""
    batch_size: int = 64
    """Micro-batch size; batches are drawn in a fixed order from ``seed`` (at most ``MAX_BATCH_SIZE``)."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer update: gradients add up, then one ``unscale_``, clip and step (at most
    ``MAX_GRAD_ACCUMULATION``)."""
    optimizer: str = "sgd"
    """``sgd``, ``adam``, ``adamw``, or ``module:function`` called with the model's parameters and
    returning a ``torch.optim.Optimizer`` (then lr, momentum, betas and weight_decay here are not used)."""
    lr: float = 0.05
    """Learning rate."""
    momentum: float = 0.9
    """SGD momentum (ignored by adam and adamw)."""
    weight_decay: float = 0.0
    """Weight decay (sgd, adam: L2 in the gradient; adamw: decoupled)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam and AdamW betas."""
    grad_clip: float | None = 1.0
    """Max total gradient norm, applied after ``unscale_``; null disables clipping."""
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    """Learning-rate schedule, driven by real updates."""
    eval_mode: bool = True
    """Run inference on the fixed set with ``model.eval()`` (true) or ``model.train()`` (false)."""
    checkpoint_every: int = 20
    """Save a resumable checkpoint every this many steps (0 disables)."""
    boundary_cases: int = 8
    """Decision-boundary cases from the trained reference (classification only; at most ``MAX_BOUNDARY_CASES``:
    each bisection costs some twenty forward passes)."""
    boundary_method: Literal["auto", "bisect", "select"] = "auto"
    """``bisect`` between ordinary inputs the reference classifies differently (floating inputs only);
    ``select`` the ordinary samples with the smallest reference top-2 margin (any input); ``auto``:
    bisect where every input is floating, select otherwise."""
    boundary_epsilon: float = 1.0e-3
    """Bisection stops when the reference's top-2 margin is below this."""
    replicates: int = 2
    """FP32 replicates freeze trains beside the reference, each under another small change of the data order (a block
    of samples traded between each pair of consecutive updates, a different block each: ``training.neighbours_swapped``):
    FP32's own run-to-run variation, against which the rule judges AMP's training (its loss curve, its final loss and
    its quality after training: docs/acceptance.md "Training"). Each costs one more FP32 training. The two bounds training is read
    by take Student's t at 0.975 each (``rule.training_confidence``): 4.3 with 2 replicates, 3.2 with 3, 2.8 with 4; 1
    replicate (12.7) is refused, a gate that passes almost anything. 0: none (then the rule may set no training
    criterion that needs them)."""
    deterministic: bool = False
    """Ask PyTorch for deterministic kernels in freeze and trial (slower on GPU; CPU results already are)."""
    fp64_arbiter: int | None = None
    """Cases of the fixed set (its first N, in order) that freeze re-runs in float64, the FP64 check's arbiter: a full
    float64 forward, on the CPU. 0: none; null (auto): every case while their float64 outputs hold at most
    ``inference.FP64_AUTO_ELEMENTS`` elements, else the first cases that fit. Not part of the reference's run key:
    it changes no training. At most ``MAX_CASES``."""
    checkpoint: str | None = None
    """A trained state that the reference, its replicates and every trial start from; null: the model as ``task.model``
    builds it. Its path is relative to the repository root. A safetensors file: either weights alone (``state_dict``
    names, as ``safetensors.torch.save_file(model.state_dict(), path)`` or a Hugging Face ``model.safetensors`` writes
    them), or a checkpoint this pipeline wrote (``pipeline/checkpoint.py``), whose optimizer, scheduler and GradScaler
    state training continues from. Or a torch distributed checkpoint's folder (``torch.distributed.checkpoint.save``,
    as FSDP2 runs write it; torch 2.4 or later): the weights under ``model`` (else its top level's tensors), and the
    optimizer's state under ``optim`` or ``optimizer``, read in one process from every rank's files. Its scheduler and
    other entries are not read. Its pickled metadata may name DCP's own classes alone: anything else is refused unrun
    (``pipeline/dcp.py``). The sha256 of the file, or of all the folder's files, is part of the reference's key. List
    the same path in freeze's ``deps`` in dvc.yaml, so that DVC re-freezes when it changes: freeze refuses to run
    otherwise."""

    def check(self, key: str) -> None:
        _count(self.train_steps, f"{key}.train_steps", MAX_MICRO_BATCHES, MICRO_BATCHES_WHY)  # 0: inference only
        _count(self.batch_size, f"{key}.batch_size", MAX_BATCH_SIZE, "samples in one micro-batch", least=1)
        _count(self.grad_accumulation, f"{key}.grad_accumulation", MAX_GRAD_ACCUMULATION, "micro-batches per update",
               least=1)
        if self.train_steps * self.grad_accumulation > MAX_MICRO_BATCHES:
            raise UserError(
                f"params.yaml: {key}.train_steps x grad_accumulation is {self.train_steps * self.grad_accumulation:,} "
                f"micro-batches; give at most {MAX_MICRO_BATCHES:,} ({MICRO_BATCHES_WHY})"
            )
        if self.optimizer not in OPTIMIZERS and not _ENTRY_POINT.match(self.optimizer):
            raise UserError(
                f"params.yaml: {key}.optimizer is {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)} or 'module:function'"
            )
        _positive(self.lr, f"{key}.lr")
        _non_negative(self.momentum, f"{key}.momentum")
        _non_negative(self.weight_decay, f"{key}.weight_decay")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserError(f"params.yaml: {key}.betas is {self.betas}; give two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.grad_clip is not None:
            _positive(self.grad_clip, f"{key}.grad_clip")
        _non_negative(self.checkpoint_every, f"{key}.checkpoint_every")
        _count(self.replicates, f"{key}.replicates", MAX_REPLICATES, "each is one more FP32 training; 4 already give "
               "Student's t 2.8 at 0.975")
        if self.replicates == 1:
            raise UserError(f"params.yaml: {key}.replicates is 1: two FP32 runs give Student's t with 1 degree of freedom "
                            f"(12.7 at 0.975), so the training bounds would pass almost any trial; give 2 or more (0: none)")
        _count(self.boundary_cases, f"{key}.boundary_cases", MAX_BOUNDARY_CASES, "each is bisected with the trained model")
        _positive(self.boundary_epsilon, f"{key}.boundary_epsilon")
        if self.fp64_arbiter is not None:
            _count(self.fp64_arbiter, f"{key}.fp64_arbiter", MAX_CASES, CASES_WHY)
        if self.checkpoint is not None:
            _printable(self.checkpoint, f"{key}.checkpoint", 4096)
            if not self.checkpoint.strip():
                raise UserError(f"params.yaml: {key}.checkpoint is empty; give the path of a safetensors file or of a "
                                f"torch distributed checkpoint's folder, or null")
        self.lr_schedule.check(f"{key}.lr_schedule")


OPTIMIZERS = ("sgd", "adam", "adamw")
MAX_REPLICATES = 16
MAX_MICRO_BATCHES = 10**7
"""Ten million micro-batches (train_steps x grad_accumulation): weeks of training on one node at 0.1 s each, and
their drawn order alone (``training.update_batches``) holds some 2 GB; 1e12 ended in a MemoryError."""
MICRO_BATCHES_WHY = "the order of every micro-batch is drawn in memory before training"
MAX_BATCH_SIZE = 10**7
"""Ten million samples per micro-batch: beyond what one node's memory holds for any model."""
MAX_GRAD_ACCUMULATION = 10**4
"""Ten thousand micro-batches per update: beyond any recipe's effective batch."""
MAX_BOUNDARY_CASES = 10**5
"""A hundred thousand decision-boundary cases: some two million forward passes of bisection at freeze."""
RENAMED = {"reference.noise_replicate": "reference.replicates (0 = none, N = N FP32 replicates; true was 1)"}


@dataclass(frozen=True)
class Policy:
    """One trial variant: what changes the arithmetic against the FP32 eager reference (docs/variants.md).

    The reference itself is ``Policy()``: float32, eager, no float8. A trial is judged against it by the same
    frozen rule whatever changed: the autocast dtype, the compiler, float8 linear layers, or several at once.
    """

    dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    """Autocast dtype; float32 runs no autocast (a compiled or float8 variant judged at FP32's own precision)."""
    compile: Literal["off", "inductor"] = "off"
    """``inductor``: the model runs through ``torch.compile`` (training and inference); ``off``: eager."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """``torch.compile``'s ``mode`` when ``compile: inductor``."""
    float8: Literal["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "off"
    """A torchao float8 training recipe for the model's linear layers (``pip install amp-validation[fp8]``):
    real kernels on GPUs of capability 8.9 and newer, the same casts emulated in software elsewhere."""
    fp32_modules: tuple[str, ...] = ()
    """Qualified module names run outside autocast (inputs cast to float32). A changed list is a new trial. Each
    printable, at most ``MAX_MODULE_NAME`` characters (they reach manifests, MLflow and the report)."""
    data_order: Literal["reference", "swapped"] = "reference"
    """``swapped``: FP32 trained again on another data order than the reference's and its replicate's
    (``training.trial_order``), nothing else changed: the rule's A/A, whose verdict should be accept. Only with
    dtype float32, compile off and float8 off; ``reference``: the reference's batches in its order (every AMP trial)."""
    fsdp_param_dtype: Literal["bfloat16", "float16"] | None = None
    """FSDP2's own mixed precision (``MixedPrecisionPolicy.param_dtype``; needs ``distributed.strategy: fsdp`` on more
    than one rank, and ``dtype: float32``): the parameters are cast to it for the whole forward and backward, so every
    op runs in it, not only autocast's list; float16 adds a GradScaler. None: FP32 parameters."""
    fsdp_reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The dtype FSDP2 reduces gradients in over the ranks (``reduce_dtype``); None: ``fsdp_param_dtype``'s."""

    @property
    def amp(self) -> bool:
        return self.dtype != "float32"

    @property
    def uses_scaler(self) -> bool:
        # FP16's narrow range needs loss scaling; BF16 has FP32's exponent range and does not.
        return self.dtype == "float16" or self.fsdp_param_dtype == "float16"

    @property
    def compiled(self) -> bool:
        return self.compile != "off"

    @property
    def eager(self) -> "Policy":
        """The same arithmetic without the compiler: what diagnosis replays to tell compile from precision."""
        return dataclasses.replace(self, compile="off", compile_mode="default")

    def as_dict(self) -> dict:
        """What a manifest records; the fields a default (autocast only) policy leaves at rest are not written."""
        out: dict = {"dtype": self.dtype, "fp32_modules": list(self.fp32_modules)}
        if self.compiled:
            out.update(compile=self.compile, compile_mode=self.compile_mode)
        if self.float8 != "off":
            out.update(float8=self.float8)
        if self.data_order != "reference":
            out.update(data_order=self.data_order)
        if self.fsdp_param_dtype is not None:
            out.update(fsdp_param_dtype=self.fsdp_param_dtype, fsdp_reduce_dtype=self.fsdp_reduce_dtype)
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "Policy":
        return build(cls, raw, "policy")

    def check(self, key: str) -> None:
        for i, module in enumerate(self.fp32_modules):
            _printable(module, f"{key}.fp32_modules[{i}]", MAX_MODULE_NAME)
        twice = sorted({m for m in self.fp32_modules if self.fp32_modules.count(m) > 1})
        if twice:
            raise UserError(
                f"params.yaml: {key}.fp32_modules lists {', '.join(map(repr, twice))} more than once; list each module once"
            )
        if self.compile == "off" and self.compile_mode != "default":
            raise UserError(
                f"params.yaml: {key}.compile_mode {self.compile_mode!r} needs compile: inductor; set both, or neither"
            )
        if self.fsdp_reduce_dtype is not None and self.fsdp_param_dtype is None:
            raise UserError(f"params.yaml: {key}.fsdp_reduce_dtype needs {key}.fsdp_param_dtype (FSDP2's mixed precision); "
                            f"set both, or neither")
        if self.fsdp_param_dtype is not None and (self.amp or self.fp32_modules):
            raise UserError(f"params.yaml: {key}.fsdp_param_dtype is FSDP2's mixed precision, not autocast; set {key}.dtype: "
                            f"float32 and no fp32_modules beside it, or judge autocast in a variant of its own")
        if self.data_order != "reference" and (self.amp or self.compiled or self.float8 != "off" or self.fsdp_param_dtype):
            raise UserError(
                f"params.yaml: {key}.data_order {self.data_order!r} is FP32's A/A and needs dtype: float32, compile: off "
                f"and float8: off (another change beside the data order could not be told from it); set those, or "
                f"data_order: reference"
            )


MAX_MODULE_NAME = 500
"""A qualified module name (``model.encoder.layers.31.self_attn.q_proj``) is some fifty characters; ten times that
is no module's."""
_VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a DVC stage suffix and a folder name
MAX_VARIANT_NAME = 64
"""A variant's name becomes a DVC stage (decide@NAME), folders, files and MLflow run names and param keys
(``trial.policies.NAME.fp32_modules``, within MLflow's 250 characters)."""


def _default_policies() -> dict:
    return {name: Policy(dtype=name) for name in DTYPES}


@dataclass(frozen=True)
class TrialConfig:
    variants: list[str] = field(default_factory=lambda: list(DTYPES))
    """The trials that run, by name (each is one variant of every per-variant stage: trial@NAME, compare@NAME...).
    A name is a DVC stage suffix, a folder and an MLflow run: letters, digits, '_', '.' and '-', at most
    ``MAX_VARIANT_NAME`` characters."""
    policies: dict[str, Policy] = field(default_factory=_default_policies)
    """Every named policy; only those listed in ``variants`` run. Stage trial@NAME depends on its own entry only."""

    def policy(self, name: str) -> Policy:
        """Raises: UserError for a name that is not a variant here."""
        if name not in self.variants:
            raise UserError(f"--variant {name} is not in trial.variants {self.variants}; add it there or pick one of them")
        return self.policies[name]

    def check(self, key: str) -> None:
        if not self.variants:
            raise UserError(f"params.yaml: {key}.variants is empty; list at least one of {sorted(self.policies)}")
        for i, name in enumerate(self.variants):
            _printable(name, f"{key}.variants[{i}]", MAX_VARIANT_NAME)
        if len(set(self.variants)) != len(self.variants):
            raise UserError(f"params.yaml: {key}.variants lists a name twice; list each once")
        for name in self.variants:
            if name not in self.policies:
                raise UserError(
                    f"params.yaml: {key}.variants lists {name!r}, which {key}.policies does not define; add "
                    f"{key}.policies.{name}: {{dtype: ...}}, or use one of {sorted(self.policies)}"
                )
        for name, policy in self.policies.items():
            _printable(name, f"{key}.policies name", MAX_VARIANT_NAME)
            if not _VARIANT_NAME.match(name):
                raise UserError(
                    f"params.yaml: {key}.policies name {name!r} cannot name a DVC stage and a folder; use letters, "
                    f"digits, '_', '.' and '-'"
                )
            prefix, _, rest = name.partition("-")
            if f"{prefix}-" in RESERVED_PREFIXES:  # decide's data/metrics/NAME.json would be another stage's file
                stage = "benchmark" if prefix == "bench" else prefix
                raise UserError(
                    f"params.yaml: {key}.policies name {name!r} would give decide@{name} the metrics file of "
                    f"{stage}@{rest} (data/metrics/{name}.json); rename it without the {prefix}- prefix"
                )
            policy.check(f"{key}.policies.{name}")


RESERVED_PREFIXES = ("bench-", "compare-")
"""Variant names may not start so: ``paths.benchmark_metrics`` and ``paths.compare_metrics`` name their files so, in
the folder where decide writes ``NAME.json`` (``paths.decision_metrics``)."""


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.05
    """Absolute tolerance: an element fails where |trial - ref| > atol + rtol * |ref|."""
    rtol: float = 0.02
    """Relative tolerance."""
    decisions: bool | None = None
    """Judge this output's decisions (argmax, ties, flips) too. true: if shaped like class scores, [N, C >= 2] or per
    token [N, T, C >= 2] (argmax), or like one logit, [N], [N, 1] or [N, T, 1] (a sigmoid's: logit >= 0); false: values
    only; null: as ``heads`` infers it. ``role`` says more and wins; stating both, they must agree."""
    role: Literal["classes", "positions", "labels", "values", "ignored"] | None = None
    """What this output is, and so how it is judged (``heads``: classes by argmax, positions by argmax over the real
    positions, labels each at a threshold, values alone, or ignored); null: inferred at freeze, and printed."""
    threshold: float | None = None
    """Role ``labels``: the value each label is decided at (null: 0 for a logit, 0.5 for a probability)."""

    def check(self, key: str) -> None:
        _non_negative(self.atol, f"{key}.atol")
        _relative(self.rtol, f"{key}.rtol", "an output of 0, or of twice the reference")
        if self.role is not None and self.decisions is not None and self.decisions != (self.role in heads.DECIDED):
            raise UserError(f"params.yaml: {key}.decisions is {str(self.decisions).lower()} but its role is {self.role}; "
                            f"drop decisions (the role says it)")
        if self.threshold is not None:
            if not math.isfinite(self.threshold):
                raise UserError(f"params.yaml: {key}.threshold is {self.threshold}; give a finite value, for example 0")
            if self.role != "labels":
                raise UserError(f"params.yaml: {key}.threshold decides role labels only; add role: labels, or drop it")


@dataclass(frozen=True)
class AcceptanceConfig:
    """The rule, fixed before any trial: its sha256 is frozen with the reference."""

    outputs: dict[str, Tolerance] = field(default_factory=lambda: {"*": Tolerance()})
    """Tolerances per named output; ``*`` applies to outputs not listed."""
    max_failing_fraction: float = 0.0
    """Largest fraction of output elements allowed outside tolerance, per output."""
    tie_rule: Literal["lowest_index", "tie_is_flip"] = "lowest_index"
    """Classification ties: take the lowest class index, or count any tie the reference lacks as a flip (a
    single-value head's tie: a logit of exactly 0, a probability of exactly 0.5)."""
    boundary_margin: float = 0.05
    """A real case (ordinary, edge) whose reference top-2 margin is below this is near the boundary: its
    flips are counted apart (``max_near_boundary_flips``), in the unit of ``boundary_margin_kind``."""
    boundary_margin_kind: Literal["logit", "probability", "relative"] = "logit"
    """Unit of ``boundary_margin``: ``logit`` (z1 - z2, depends on the scores' scale), ``probability``
    (p1 - p2 of the softmax, in [0, 1]: means the same for every model) or ``relative`` ((z1 - z2) / std
    of the row's live scores: a class more than 104 below the maximum, at probability 0, masked or not, is left out)."""
    max_flips: int = 0
    """Decision flips allowed among real cases that are not near the boundary (per token for [N, T, C])."""
    max_near_boundary_flips: int | None = 0
    """Decision flips allowed among real cases near the boundary (0 by default: every flip of a real sample
    fails the rule and is named); null: not limited, said so in the verdict, every such flip still listed."""
    max_flip_rate: float | None = None
    """Instead of the counts above: the largest rate of changed decisions over the application's inputs, tested on its
    exact Clopper–Pearson upper bound at ``confidence`` over the ordinary cases, the set's independent draws (edge and
    selected cases' flips count against them, their cases do not: ``decisions.rate_sample``), and the quality drop on its
    paired upper bound. A small set cannot pass it: decide says how many cases it needs. null: counts."""
    confidence: float = 0.95
    """Confidence of the statistical bounds (``max_flip_rate``)."""
    max_boundary_flip_fraction: float = 1.0
    """Fraction of the constructed boundary cases (kind ``boundary``) allowed to flip (they are always listed)."""
    max_kl_mean: float | None = None
    """Per-token outputs: largest mean over tokens of KL(reference || trial) in nats; null: not applied.
    Needs the full score vectors of both sides (or top-k logits plus log-sum-exp, bounding the rest)."""
    max_kl_p99: float | None = None
    """Per-token outputs: largest 99th percentile (nearest rank) of the per-token KL; null: not applied."""
    min_top1_agreement: float | None = None
    """Per-token outputs: smallest fraction of tokens whose top-1 class is the reference's; null: not applied.
    Needs only each side's argmax per token."""
    threshold: float | None = None
    """Regression only: decision threshold; a case flips where any value of its primary output (at a kept position)
    is on the other side of it in the trial. null: a primary named like logits or probabilities whose targets are 0 or
    1 (or said ``decisions: true``) is decided at 0 or 0.5, each label of a multi-label head on its own
    (``heads.decision_threshold``), any other primary by its values alone."""
    min_quality: float | None = None
    """Minimum quality of the trial on the fixed set (accuracy, or -RMSE for regression); null: no minimum."""
    max_quality_drop: float | None = 0.01
    """Largest drop of quality versus the reference, inference and after training, counted over the same cases
    (accuracy, top_k: in cases, not rounded fractions). null, with min_quality null: quality not judged (the
    only way to accept on a fixed set without targets)."""
    loss_rtol: float | None = None
    """Training: a fixed per-step band |loss_amp - loss_fp32| <= loss_atol + loss_rtol * |loss_fp32| (a null part
    counts 0). Stated, it is calibrated at freeze: FP32's own replicate must stay inside it at every step, or freeze
    refuses it and gives the band FP32 passes. null with loss_atol null (the default): no fixed band; the loss curve is
    judged against FP32's own run-to-run spread (``loss_noise_multiple``), since two trainings that differ in rounding
    decorrelate after some steps, as two FP32 runs on another data order do."""
    loss_atol: float | None = None
    """Training: absolute part of the per-step loss band (null: see ``loss_rtol``)."""
    max_skipped_fraction: float = 0.1
    """Training: largest fraction of steps whose update the GradScaler skipped, after its calibration (the skips that open
    a run before its first real update, at a finite loss, while the scale halves to one that fits: said, not counted)."""
    stall_window: int = 10
    """Training: updates stopped advancing if none of the last this many steps made a real update."""
    min_scale: float = 1.0
    """Training: the final GradScaler scale must be at least this: below 1, float16 does not hold the model's gradients at
    their own size (the scaler shrinks them). Whether updates still advanced is the skip and stall checks' to say."""
    loss_noise_multiple: float | None = 3.0
    """Training, noise floor: AMP's loss curve against FP32's, bounded by FP32's own run-to-run variation: the
    mean and the largest per-step |loss_amp - loss_fp32| each at most loss_noise_multiple times those of the
    FP32 replicate (FP32 again, another data order: ``training.neighbours_swapped``) plus loss_noise_atol.
    Needs reference.replicates; null (with loss_noise_atol null): not applied."""
    loss_noise_atol: float | None = None
    """Training, noise floor: absolute part of that band."""
    min_amp_share: float | None = 0.1
    """Smallest share of the matmul, convolution and attention FLOPs that a reduced-precision policy must run in
    float16, bfloat16 or float8 beyond its FP32 reference's (the trial's audit): below it the variant is no AMP accept
    and is rolled back, and diagnose suggests no FP32 region under it. 0.1 is the audit's own line (Amdahl: with a
    share s faster, a step is at most 1 / (1 - s) faster: 1.11x at 10 %, which autocast's casts and run-to-run noise
    eat). An FP32 policy (compile only) makes no precision claim and is not judged. null: not applied, said in the verdict."""

    def check(self, key: str) -> None:
        if not self.outputs:
            raise UserError(f"params.yaml: {key}.outputs is empty; give at least '*': {{atol: ..., rtol: ...}}")
        for name, tol in self.outputs.items():
            tol.check(f"{key}.outputs.{name}")
        _fraction(self.max_failing_fraction, f"{key}.max_failing_fraction")
        _non_negative(self.boundary_margin, f"{key}.boundary_margin")
        _non_negative(self.max_flips, f"{key}.max_flips")
        _fraction(self.max_boundary_flip_fraction, f"{key}.max_boundary_flip_fraction")
        if self.max_quality_drop is not None:
            _non_negative(self.max_quality_drop, f"{key}.max_quality_drop")
        if self.max_flip_rate is not None:
            _fraction(self.max_flip_rate, f"{key}.max_flip_rate")
        if not 0.5 <= self.confidence < 1.0:
            raise UserError(
                f"params.yaml: {key}.confidence is {self.confidence}; give a confidence in [0.5, 1), for example 0.95"
            )
        if self.loss_rtol is not None:
            _relative(self.loss_rtol, f"{key}.loss_rtol", "a training loss of 0, or of twice FP32's")
        if self.loss_atol is not None:
            _non_negative(self.loss_atol, f"{key}.loss_atol")
        _fraction(self.max_skipped_fraction, f"{key}.max_skipped_fraction")
        _positive(self.stall_window, f"{key}.stall_window")
        _non_negative(self.min_scale, f"{key}.min_scale")
        for name in ("max_near_boundary_flips", "max_kl_mean", "max_kl_p99", "loss_noise_multiple", "loss_noise_atol"):
            if getattr(self, name) is not None:
                _non_negative(getattr(self, name), f"{key}.{name}")
        if self.min_top1_agreement is not None:
            _fraction(self.min_top1_agreement, f"{key}.min_top1_agreement")
        if self.min_amp_share is not None:
            _fraction(self.min_amp_share, f"{key}.min_amp_share")
        if self.boundary_margin_kind == "probability":
            _fraction(self.boundary_margin, f"{key}.boundary_margin")

    @property
    def judges_quality(self) -> bool:
        """Whether the rule sets a quality criterion (``max_quality_drop`` or ``min_quality``)."""
        return self.max_quality_drop is not None or self.min_quality is not None

    def tolerance(self, output: str) -> Tolerance:
        """The entry for ``output``, else ``*``; no hidden default (``check_outputs`` refuses the gap at freeze)."""
        tol = self.outputs.get(output, self.outputs.get("*"))
        if tol is None:
            raise UserError(
                f"params.yaml: acceptance.outputs has no entry for output '{output}' and no '*'; add "
                f"'{output}': {{atol: ..., rtol: ...}} in the output's own units"
            )
        return tol

    @property
    def has_loss_band(self) -> bool:
        """Whether the rule states a fixed per-step loss band (``loss_atol`` or ``loss_rtol`` not null)."""
        return self.loss_atol is not None or self.loss_rtol is not None

    def loss_band(self, ref_loss):
        """The training gap allowed at a step whose FP32 loss is ``ref_loss`` (a float, or a tensor of steps):
        ``loss_atol + loss_rtol * |ref_loss|`` (a null part counts 0); NaN where the reference loss is, which no gap is
        within. Only where ``has_loss_band``."""
        return (self.loss_atol or 0.0) + (self.loss_rtol or 0.0) * abs(ref_loss)

    def sha256(self) -> str:
        """Hash of the rule in canonical form: the same rule always gives the same hash."""
        rule = dataclasses.asdict(self)
        for entry in rule["outputs"].values():  # the keys added with output roles hash as before where unsaid
            for key in ("role", "threshold"):
                if entry[key] is None:
                    del entry[key]
        canonical = json.dumps(rule, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class CompareConfig:
    """How compare@DTYPE reads and reports; nothing here changes a verdict (the rule is ``acceptance``)."""

    chunk_elements: int = 4_000_000
    """Output elements per chunk: compare holds one chunk of the reference, the trial and the FP64 arbiter
    (16 MB each in float32, plus a few temporaries of that size), whatever the fixed set's size. At most
    ``MAX_CHUNK_ELEMENTS``."""
    table_rows: int = 100
    """The per-case table keeps every flipped case and this many worst others (largest gap, or KL per token; at most
    ``MAX_LISTED``)."""
    max_listed_flips: int = 10_000
    """Per-token outputs: most flipped tokens listed one by one in stats.json (their count stays exact; at most
    ``MAX_LISTED``)."""
    store: Literal["full", "compact", "auto"] = "auto"
    """How trial@NAME stores per-token float32 scores [N, T, V]: ``full`` (4 bytes per entry), ``compact`` (2 bytes:
    ``artifacts.compact``; decisions and margins exact from its kept row statistics, KL exact because each trial keeps
    its per-token KL against the reference's full scores) or ``auto`` (compact above 1 GiB per source). freeze always
    stores the reference full; other outputs are always full; compare reads either."""

    def check(self, key: str) -> None:
        _count(self.chunk_elements, f"{key}.chunk_elements", MAX_CHUNK_ELEMENTS,
               "4 GB per float32 copy, and compare holds several", least=1)
        _count(self.table_rows, f"{key}.table_rows", MAX_LISTED, "each row is written to cases.json")
        _count(self.max_listed_flips, f"{key}.max_listed_flips", MAX_LISTED, "each is written to stats.json")


MAX_CHUNK_ELEMENTS = 10**9
"""A billion elements per chunk: 4 GB per float32 copy, and compare holds several at once."""
MAX_LISTED = 10**6
"""A million rows or flips listed one by one: a JSON file of a few hundred MB, more than anyone reads."""


@dataclass(frozen=True)
class BenchConfig:
    """How benchmark@DTYPE measures (the method is in pipeline/bench/); the workload is the trial's.

    A field left null is sized by device (``bench.sizing.SIZES``): short on the CPU, where the figures only show
    that the method runs, long enough on a GPU for medians and IQRs worth quoting."""

    warmup: int | None = None
    """Untimed steps of each variant before any round (allocator, kernel choice, autocast cache)."""
    repeats: int | None = None
    """Rounds: each times every variant (FP32, TF32 where the GPU has it, AMP) in rotating order, and each
    memory probe records one peak per round; medians, IQRs and per-round ratios come from these."""
    steps: int | None = None
    """Back-to-back training steps per round, timed together (one clock reading per round). ``warmup``, ``repeats``
    and ``steps`` are each at most ``MAX_BENCH_COUNT``."""

    def check(self, key: str) -> None:
        why = "each is one more timed training step or round per variant"
        if self.warmup is not None:
            _count(self.warmup, f"{key}.warmup", MAX_BENCH_COUNT, why)
        if self.repeats is not None:
            _count(self.repeats, f"{key}.repeats", MAX_BENCH_COUNT, why, least=1)
        if self.steps is not None:
            _count(self.steps, f"{key}.steps", MAX_BENCH_COUNT, why, least=1)


MAX_BENCH_COUNT = 10**5
"""A hundred thousand warm-up steps, rounds or steps per round: hours of timing per variant on a GPU already."""


@dataclass(frozen=True)
class DistributedConfig:
    """Data parallelism of freeze and trial@DTYPE (docs/distributed.md; method in pipeline/distributed.py)."""

    nproc_per_node: int = 1
    """Ranks on this machine. 1: one process, as always. N > 1: the stage re-runs itself under
    ``torchrun --standalone --nproc_per_node N`` with DistributedDataParallel (gloo on CPU, NCCL/RCCL on GPUs,
    one GPU per rank); reference.batch_size stays the global batch and must be divisible by N. At most
    ``MAX_NPROC_PER_NODE``."""
    nnodes: int = 1
    """Machines. N > 1: every node runs the same stage command, and torchrun's c10d rendezvous at ``rdzv_endpoint``
    makes nnodes x nproc_per_node ranks of them (global rank 0 writes: the nodes share the repository's filesystem);
    reference.batch_size must be divisible by that world size (docs/distributed-multinode.md). At most ``MAX_NNODES``."""
    rdzv_endpoint: str | None = None
    """``host:port`` every node reaches, where the rendezvous is held (a free port of the first node, usually); needed
    when nnodes > 1."""
    launcher: list[str] = field(default_factory=list)
    """Words put before torchrun's command when nnodes > 1, which start that command on every node: ``[srun,
    --ntasks-per-node=1]`` inside a Slurm allocation, so that ``dvc repro`` on one node runs the whole pipeline. Empty:
    this node only; start the same stage command on the others yourself."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """``ddp``: every rank holds the whole training state (DistributedDataParallel). ``fsdp``: FSDP2 ``fully_shard``
    shards parameters, gradients and optimizer state over the ranks (docs/distributed.md, "FSDP2"). One process: either
    runs the model as it is."""
    fsdp_blocks: list[str] = field(default_factory=list)
    """With ``fsdp``: class names of the modules sharded one by one (a transformer's layer class, e.g. ``[BertLayer]``),
    then the root; or one ``module:function`` that, given the model, returns its blocks (a list of its submodules).
    Empty: each top-level child with parameters is one block."""

    def check(self, key: str) -> None:
        if self.fsdp_blocks and self.strategy != "fsdp":
            raise UserError(f"params.yaml: {key}.fsdp_blocks is set but {key}.strategy is {self.strategy!r}; set strategy: "
                            f"fsdp, or remove fsdp_blocks")
        for i, name in enumerate(self.fsdp_blocks):
            _printable(name, f"{key}.fsdp_blocks[{i}]", MAX_MODULE_NAME)
            if ":" in name and (len(self.fsdp_blocks) > 1 or not _ENTRY_POINT.match(name)):
                raise UserError(f"params.yaml: {key}.fsdp_blocks[{i}] is {name!r}; give class names, or one 'module:function' "
                                f"alone that returns the model's blocks")
        _count(self.nproc_per_node, f"{key}.nproc_per_node", MAX_NPROC_PER_NODE,
               "one process per rank, each with its own copy of the model", least=1)
        _count(self.nnodes, f"{key}.nnodes", MAX_NNODES, "each node joins one rendezvous", least=1)
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise UserError(f"params.yaml: {key}.nnodes is {self.nnodes} but {key}.rdzv_endpoint is null; give the "
                            f"host:port every node reaches (the first node's name and a free port, e.g. node001:29500)")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536 or not self.rdzv_endpoint.isprintable():
                raise UserError(f"params.yaml: {key}.rdzv_endpoint is {self.rdzv_endpoint!r}; give host:port, e.g. "
                                f"node001:29500")
        for i, word in enumerate(self.launcher):
            _printable(word, f"{key}.launcher[{i}]", 4096)


MAX_NPROC_PER_NODE = 64
"""Sixty-four ranks on one machine: a node holds 8 to 16 GPUs, and each CPU rank holds a copy of the model."""
MAX_NNODES = 4096
"""Four thousand and ninety-six machines: beyond the largest training jobs' node counts."""


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str = "amp-validation"
    """MLflow experiment name: printable (no control characters), at most ``MAX_EXPERIMENT_NAME`` characters."""

    def check(self, key: str) -> None:
        if not self.experiment.strip():
            raise UserError(f"params.yaml: {key}.experiment is empty; give the MLflow experiment a name")
        _printable(self.experiment, f"{key}.experiment", MAX_EXPERIMENT_NAME)


MAX_EXPERIMENT_NAME = 500
"""MLflow's own limit on an experiment's name (``mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH``)."""


@dataclass(frozen=True)
class DiagnoseConfig:
    """What diagnose@DTYPE may spend. Nothing here changes a trial: suggestions are written, never applied."""

    probe: Literal["always", "on_failure", "never"] = "on_failure"
    """When to map the precision of every op and measure gradient underflow on one training batch (a few
    passes): ``always`` (also for healthy trials: one process with torch and the model, ~the cost of a
    tiny trial), ``on_failure`` (a healthy trial then costs a JSON read), or ``never``."""
    search_budget: int = 4
    """Most trial re-runs (inference and training under a candidate ``fp32_modules``) the FP32-region
    search may spend; 0 still locates the first non-finite value but checks no suggestion. At most
    ``MAX_SEARCH_BUDGET``."""
    max_cases: int = 16
    """Most failing fixed-set cases replayed when locating a non-finite output (at most ``MAX_CASES``)."""

    def check(self, key: str) -> None:
        _count(self.search_budget, f"{key}.search_budget", MAX_SEARCH_BUDGET, "each is one more trial re-run")
        _count(self.max_cases, f"{key}.max_cases", MAX_CASES, "each failing case is replayed", least=1)


MAX_SEARCH_BUDGET = 1000
"""A thousand trial re-runs: each is a whole trial; more than a model has modules worth running in FP32."""


@dataclass(frozen=True)
class Params:
    seed: int = 0
    """Seeds weights, batch order and every random draw."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` takes a GPU (CUDA or ROCm) when present, else the CPU; ``cuda`` stops with one line when none is
    visible (what a GPU CI job asks for, so that it can never pass on the CPU)."""
    threads: int | None = 1
    """CPU threads of every stage (intra-op; inter-op too), applied before torch starts. CPU float sums are
    blocked by thread, so another count changes the bytes of every output; 1 makes the CPU example
    reproduce on any machine. null: torch's default (one per core), faster, bytes then tied to the core count.
    At most ``MAX_THREADS``."""
    task: TaskConfig = field(default_factory=TaskConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def check(self, key: str = "") -> None:
        _non_negative(self.seed, "seed")
        if self.seed >= 2**63:  # torch's generators take 64 bits, and the runs derive seeds from it (seed + 1...)
            raise UserError(f"params.yaml: seed is {self.seed}; give one below 2**63 (9223372036854775808)")
        if self.threads is not None:
            _count(self.threads, "threads", MAX_THREADS, "more than any one machine has cores; null takes one per core",
                   least=1)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value.check(f.name)
        _check_min_quality(self)
        _check_compiled_dropout(self)
        noise_rule = self.acceptance.loss_noise_multiple is not None or self.acceptance.loss_noise_atol is not None
        if noise_rule and not self.reference.replicates:
            raise UserError(
                "params.yaml: acceptance.loss_noise_multiple bounds the training gap by FP32's own run-to-run variation, which "
                "reference.replicates: 0 does not measure; set replicates: 2, or loss_noise_multiple: null "
                "and loss_noise_atol: null to judge training by a fixed band (loss_atol) alone"
            )


MAX_THREADS = 1024
"""A fixed ceiling, not the core count of the machine that reads params.yaml: ``threads`` is a DVC param that changes
the bytes of every CPU output, and one file must load alike everywhere. 1024 is above the logical cores of any one
node today (two 192-core sockets with SMT: 768); 1,000,000 died inside libgomp."""


def compiled_variants(params: "Params") -> list[str]:
    """The trial variants that compile the model (``compile`` other than off): their kernels draw their own random
    numbers, so a forward that draws at inference cannot be compared with eager FP32 through them."""
    return [n for n in params.trial.variants if params.trial.policies[n].compile != "off"]


def _check_compiled_dropout(params: "Params") -> None:
    """Inference in train mode (``reference.eval_mode: false``) draws dropout masks from ``INFERENCE_SEED`` on every
    pass, so that FP32 against FP32 is identical; a compiled trial draws its masks in inductor's own kernels, not
    eager's, and would differ from the reference by the draws, judged as the trial's (every value moved, decisions
    flipped): a rollback no precision caused. Refused while any variant compiles."""
    if params.reference.eval_mode:
        return
    compiled = compiled_variants(params)
    if compiled:
        raise UserError(
            f"params.yaml: reference.eval_mode: false keeps dropout on at inference, and trial variant {compiled[0]!r} "
            f"compiles the model, whose dropout draws other masks than eager FP32's: their difference would be judged as "
            f"the trial's; set reference.eval_mode: true, or compile: off in trial.policies.{compiled[0]}"
        )


def _check_min_quality(params: "Params") -> None:
    """A ``min_quality`` the metric cannot reach (0.9 with -RMSE) would roll back every trial: refuse it here."""
    floor = getattr(params.acceptance, "min_quality", None)
    if floor is None:
        return
    lo, hi = params.task.metric_range
    if not lo <= floor <= hi:
        span = f"[{lo:g}, {hi:g}]".replace("-inf", "-∞").replace("inf", "∞")
        hint = "for example -1.0 (an RMSE of at most 1), or null" if hi <= 0 else "or null"
        lo_labels, hi_labels = metric_range("label_accuracy")
        if params.task.kind == "regression" and params.task.metric == "auto" and lo_labels <= floor <= hi_labels:
            # A fraction meant for labels 0 or 1 (a multi-label head): freeze would read it by label accuracy only where
            # the head is decided at a threshold; said here, the fix passes every later check.
            hint += "; or, for a head decided on labels 0 or 1 (multi-label), task.metric: label_accuracy"
        raise UserError(
            f"params.yaml: acceptance.min_quality {floor} is outside the range {span} of task.metric "
            f"{params.task.metric_name}; use a value in that range, {hint}"
        )


class Yaml12Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser where PyYAML has it: 10x faster
    """PyYAML's safe loader, reading numbers and booleans as YAML 1.2 (and DVC, which reads params.yaml with ruamel) does.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent: ``1e-4`` and ``1.0e30`` would
    be strings there, while ``dvc exp run -S`` and ``dvc params diff`` see floats. Integers keep PyYAML's
    rule (it is checked first) less its base-60 numbers (``1:30`` is 90 in YAML 1.1, text in 1.2: dvc.lock
    writes such text unquoted); a leading zero, read differently by the two, never comes from dvc.lock (DVC
    quotes such text) nor from params.yaml (``ParamsLoader`` refuses it). This adds the 1.2 floats PyYAML misses
    (``+.5`` too). Booleans are ``true`` and ``false`` only: YAML 1.1 also reads ``off``, ``on``, ``yes`` and
    ``no`` as booleans, and ``compile: off`` is a word here.
    """


Yaml12Loader.yaml_implicit_resolvers = {  # the copy add_implicit_resolver would make: drop YAML 1.1's numbers and booleans...
    first: [(tag, regexp) for tag, regexp in resolvers if tag.rsplit(":", 1)[-1] not in ("bool", "int", "float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _regexp, _first in (  # ...and keep YAML 1.2's, integers first (PyYAML's order): ``12`` is no float
    ("int", r"^[-+]?(?:0b[0-1_]+|0[0-7_]+|0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)$", "-+0123456789"),
    ("float", r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
              r"|\.(?:nan|NaN|NAN))$", "-+0123456789."),
    ("float", r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$", "-+0123456789."),
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
):
    Yaml12Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_regexp), list(_first))

_AMBIGUOUS = re.compile(r"^[-+]?(?:0[0-9_]+|0o[0-7_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)$")
"""Plain scalars YAML 1.1 and 1.2 read differently: ``010`` (8 or 10), ``08`` (text or 8), ``0o10`` (text or 8),
``1:30`` (90 or text). Other tools reading params.yaml (PyYAML is 1.1) would disagree with DVC and the stages."""


class ParamsLoader(Yaml12Loader):
    """``Yaml12Loader`` for files people write (params.yaml): a key given twice, which PyYAML silently reads as
    its last value and DVC refuses (the whole file), and a scalar YAML 1.1 and 1.2 read differently (``seed:
    010``: 8 for PyYAML, 10 in dvc.lock) are refused in one line that names the key and the fix, before
    anything is built from the file. dvc.lock, written by DVC, is read with ``Yaml12Loader``."""

    def construct_document(self, node: yaml.Node) -> Any:
        _check_nodes(node, "", set())
        return super().construct_document(node)


def _check_nodes(node: yaml.Node, key: str, seen: set[int]) -> None:
    """Refuse a duplicate key or an ambiguous plain scalar under ``node`` (``key``: its dotted name). ``seen``: the
    nodes walked already; an alias is walked once (``&x [1, *x]`` holds itself)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        if not node.style and _AMBIGUOUS.match(node.value):  # plain: None from PyYAML, "" from libyaml
            raise UserError(
                f"params.yaml: {key or 'top level'} is {node.value} (line {node.start_mark.line + 1}), which YAML 1.1 "
                f"(PyYAML) and YAML 1.2 (DVC) read differently; write the number plainly (no leading zero, no colon), "
                f"or quote it ('{node.value}') to mean text"
            )
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_nodes(item, f"{key}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            name, line = _join(key, str(key_node.value)), key_node.start_mark.line + 1
            if (key_node.tag, key_node.value) in lines:
                raise UserError(
                    f"params.yaml: key {name!r} is given twice (lines {lines[key_node.tag, key_node.value]} and {line}); "
                    f"DVC refuses such a file and PyYAML keeps the last silently: keep one"
                )
            lines[key_node.tag, key_node.value] = line
            _check_nodes(value_node, name, seen)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate params.yaml.

    Raises:
        UserError: the file is missing or malformed, or a key is unknown, mistyped or impossible.
    """
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=ParamsLoader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise UserError(f"{path} not found; run from the repository root or pass --params PATH") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a folder, not a params file; pass --params PATH of a YAML file") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path} is not valid YAML{where}; fix the syntax there") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path} must be a mapping of sections (seed, device, task, ...); it is a {type(raw).__name__}")
    params = build(Params, raw, "")
    params.check()
    return params


def build(cls: type, raw: Any, key: str) -> Any:
    """Turn a plain mapping into the dataclass ``cls``, naming the first key that does not fit."""
    if not isinstance(raw, dict):
        raise UserError(f"params.yaml: {key or 'top level'} must be a mapping, got {_show(raw)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for name in raw:
        if _join(key, str(name)) in RENAMED:
            raise UserError(f"params.yaml: {_join(key, str(name))} is now {RENAMED[_join(key, str(name))]}; rename it")
        if name not in names:
            raise UserError(
                f"params.yaml: unknown key {_join(key, str(name))!r}; remove it or use one of: {', '.join(names)}"
            )
    values = {name: _coerce(hints[name], raw[name], _join(key, name)) for name in names if name in raw}
    return cls(**values)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is Literal:
        if value is False and "off" in args:  # `off` read by a YAML 1.1 tool (PyYAML's safe_load) and written back
            return "off"
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise UserError(f"params.yaml: {key} is {_show(value)}; use one of {choices}")
        return value
    if origin is tuple:  # tuple[X, ...]: a YAML list, kept immutable
        if not isinstance(value, (list, tuple)):
            raise UserError(f"params.yaml: {key} must be a list, got {_show(value)}")
        return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"params.yaml: {key} must be a list, got {_show(value)}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"params.yaml: {key} must be a mapping, got {_show(value)}")
        return {str(k): _coerce(args[1], v, _join(key, str(k))) for k, v in value.items()}
    if hint is dict:
        if not isinstance(value, dict):
            raise UserError(f"params.yaml: {key} must be a mapping, got {_show(value)}")
        _check_free_form(value, key)
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"params.yaml: {key} must be true or false, got {_show(value)}")
        return value
    if hint is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)  # `1e3` is a YAML float: a count written that way is still a whole number
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"params.yaml: {key} must be an integer, got {_show(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"params.yaml: {key} must be a number, got {_show(value)}")
        if not math.isfinite(value):
            raise UserError(f"params.yaml: {key} is {value}; use a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise UserError(f"params.yaml: {key} must be a string, got {_show(value)}")
        return value
    raise AssertionError(f"unsupported type {hint!r} for {key}")


MAX_FREE_FORM_VALUES = 10_000
"""Values a free-form mapping (``task.options``) may hold once YAML aliases are expanded: keyword arguments, a few
dozen in practice. YAML shares an aliased node, so nine nested lists of ten aliases are a billion values to
anything that copies or hashes them (``dataclasses.asdict``, the run key): that hung freeze."""
MAX_FREE_FORM_DEPTH = 32
"""Nesting of a free-form mapping: an alias that holds itself (``&x [1, *x]``) nests without end."""


def _check_free_form(value: Any, key: str) -> None:
    """Refuse a free-form value (kept as YAML gave it) that expands past ``MAX_FREE_FORM_VALUES`` values or nests past
    ``MAX_FREE_FORM_DEPTH``; walks at most that many values, so an alias bomb costs nothing here.

    Raises:
        UserError: naming the key where the budget ran out.
    """
    left = MAX_FREE_FORM_VALUES
    stack: list[tuple[Any, str, int]] = [(value, key, 0)]
    while stack:
        node, name, depth = stack.pop()
        left -= 1
        if left < 0:
            raise UserError(
                f"params.yaml: {key} holds more than {MAX_FREE_FORM_VALUES:,} values once its YAML aliases (*name) are "
                f"expanded (at {name}); write the values out, or load large data in the task's own function"
            )
        if depth > MAX_FREE_FORM_DEPTH:
            raise UserError(
                f"params.yaml: {key} nests more than {MAX_FREE_FORM_DEPTH} levels deep (at {name[:len(key) + 40]}...: a "
                f"YAML alias that holds itself?); flatten it"
            )
        if isinstance(node, dict):
            stack.extend((v, _join(name, str(k)), depth + 1) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((v, f"{name}[{i}]", depth + 1) for i, v in reversed(list(enumerate(node))))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "nothing (null)"


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise UserError(f"params.yaml: {key} is {value}; it must be greater than 0")


def _non_negative(value: float, key: str) -> None:
    if value < 0:
        raise UserError(f"params.yaml: {key} is {value}; it must be 0 or more")


def _count(value: int, key: str, limit: int, why: str, least: int = 0) -> None:
    """A count that allocates or runs per unit: at least ``least`` (0 or 1), at most ``limit`` (``why``: what each
    unit costs), so that a typo (``1e12``) is refused in one line instead of ending in a MemoryError hours later."""
    (_positive if least else _non_negative)(value, key)
    if value > limit:
        raise UserError(f"params.yaml: {key} is {value:,}; give at most {limit:,} ({why})")


def _printable(value: str, key: str, limit: int) -> None:
    """A name that reaches other systems (MLflow, DVC, folders, the report): printable and at most ``limit`` long."""
    if not value.isprintable():
        char = next(c for c in value if not c.isprintable())
        raise UserError(
            f"params.yaml: {key} is {value[:60]!r}, which holds the non-printable character {char!r}; "
            f"write it with printable characters only"
        )
    if len(value) > limit:
        raise UserError(f"params.yaml: {key} is {len(value):,} characters long ({value[:40]!r}...); give at most {limit}")


def _relative(value: float, key: str, passes: str) -> None:
    """A relative tolerance: 0 <= value < 1 (at 1, |t - r| <= |r| lets ``passes`` through: a criterion that cannot fail)."""
    _non_negative(value, key)
    if value >= 1:
        raise UserError(f"params.yaml: {key} is {value:g}, so {passes} would pass; give a relative tolerance below 1, "
                        f"for example 0.02")


def _fraction(value: float, key: str) -> None:
    if not 0 <= value <= 1:
        raise UserError(f"params.yaml: {key} is {value}; it must be a fraction between 0 and 1")
