"""The "AMP engaged" audit of one variant (``audit.json`` in the folder its stage writes), one owner.

A variant's speedup is a claim about reduced precision only when the model's matmul, convolution and attention
work really ran in it. The audit (computed by ``pipeline.diagnosis.audit`` from the precision map's dispatch
trace, with shapes) says how much of that work, FLOP-weighted, ran in float16, bfloat16 or float8, and lists the
ops that stayed in float32 or wider: silently (a custom op outside autocast's lists, a forward that disables
autocast or computes in float64) or because the policy's ``fp32_modules`` keeps them there. Torch-free: the
report and the benchmark read it without torch.

API:
    write(folder, audit: Audit) -> None
    read(folder, produced_by="", sha256=None) -> Audit    raises UserError when the file is missing, differs from
                                                          ``sha256`` or is of another form
    Audit.from_dict(raw) / Audit.as_dict()
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline import paths
from pipeline.artifacts.record import Record
from pipeline.files import read_json, rerun, write_json

FILE = paths.TRIAL_AUDIT

UNSUPPORTED_BELOW = 0.10
"""A variant whose reduced-precision share (beyond its FP32 reference's) is below this is flagged. Amdahl: when only
a share s of the work gets faster, the whole step gets at most 1 / (1 - s) faster, however fast the reduced kernels
are; below 10 % that is at most 1.11x, which the casts autocast adds around the same ops eat, and which lies within
a CPU or shared GPU's run-to-run noise. A speedup measured on such a variant comes from something else."""


@dataclass(frozen=True)
class AuditedOp(Record):
    """One matmul-like op of the trace: where it ran, on what shapes, in which precision, and its FLOPs."""

    phase: str
    """forward, loss or backward."""
    module: str
    """Qualified name of the module it ran for ("" for the model's own code); in backward, the module whose output
    gradient arrived last, or its parent once the gradient of its input is computed."""
    module_type: str
    op: str
    """The aten overload, e.g. ``aten.mm.default``."""
    category: str
    """matmul, convolution or attention."""
    precision: str
    """float8, bfloat16, float16, float32 or float64."""
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of its floating-point inputs, in call order."""
    count: int
    flops: int
    """All calls together (PyTorch's FLOP formulas: 2*M*N*K per matmul, 2 * output size * kernel * in-channels /
    groups per convolution, 4*B*H*L*S*E per attention forward)."""
    share: float
    """Of the pass's matmul, convolution and attention FLOPs."""
    by_policy: bool
    """Its module is, or lies under, one of the policy's ``fp32_modules``."""


@dataclass(frozen=True)
class Share(Record):
    flops: int
    reduced_flops: int
    reduced_share: float | None
    """None when there is no such work."""


@dataclass(frozen=True)
class Audit(Record):
    """How much of one training pass's matmul, convolution and attention work ran in reduced precision."""

    policy: dict
    batch: int
    threshold: float
    total: Share
    by_category: dict[str, Share]
    """matmul, convolution, attention (only those present)."""
    by_phase: dict[str, Share]
    by_precision: dict[str, int]
    """FLOPs per precision."""
    reference_reduced_share: float | None
    """The same pass of the FP32 reference (no autocast): above 0 for a model already cast to a reduced dtype. None for a
    float8 variant, whose model carries its float8 layers in both passes."""
    stayed_fp32: tuple[AuditedOp, ...]
    """Ops in float32 or wider that no ``fp32_modules`` entry asked for, largest first."""
    kept_fp32: tuple[AuditedOp, ...]
    """Ops in float32 or wider because the policy's ``fp32_modules`` keeps their module there, largest first."""
    uncounted: tuple[str, ...]
    """Matmul-like ops the trace saw without a FLOP formula: left out of every share."""
    expects_reduced: bool
    """The policy asks for reduced precision (an autocast dtype, or float8)."""
    flagged: bool
    """It asks for reduced precision and its share gained over the reference is below ``threshold``."""
    speedup_claim: str
    """``supported``, ``unsupported`` (flagged) or ``not a precision claim`` (an FP32 policy, e.g. compile only)."""
    line: str
    """The one sentence the report prints."""


def write(folder: str | Path, audit: Audit) -> None:
    write_json(Path(folder) / FILE, audit.as_dict())


def read(folder: str | Path, produced_by: str = "", sha256: str | None = None) -> Audit:
    """``sha256``: what the folder's manifest records (``audit.json`` then must match it).

    Raises: UserError when the folder holds no audit, one that differs from ``sha256``, or one of another version."""
    path = Path(folder) / FILE
    return Audit.parse(
        read_json(path, produced_by, sha256),
        lambda _: f"{path} is not an audit of this version; rebuild it with {rerun(produced_by)}",
    )
