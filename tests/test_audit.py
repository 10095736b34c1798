"""The "AMP engaged" audit on tiny real models under real autocast on the CPU, each with an answer worked out by hand:
the FLOPs of every matmul, convolution and attention from its shapes, and the share that ran in reduced precision."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import import_or_skip
from pipeline.artifacts import audit as audit_file
from pipeline.config import Policy
from pipeline.diagnosis.audit import audit
from pipeline.errors import UserError

CPU = torch.device("cpu")


def mm(m: int, k: int, n: int) -> int:
    """FLOPs of an [m, k] x [k, n] product."""
    return 2 * m * k * n


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def test_mlp_under_bf16_autocast_runs_all_its_matmul_flops_in_bf16():
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    a = audit(mlp(), x, y, F.cross_entropy, Policy(dtype="bfloat16"), CPU)
    # forward 4x8x16 and 4x16x3; backward: both weight gradients, and the input gradient of the second layer only
    # (the batch does not require a gradient)
    assert a.total.flops == 2 * mm(4, 8, 16) + 3 * mm(4, 16, 3) == 3200
    assert a.total.reduced_share == 1.0 and a.by_precision == {"bfloat16": 3200}
    assert a.stayed_fp32 == () and a.kept_fp32 == () and a.uncounted == ()
    assert a.reference_reduced_share == 0.0 and not a.flagged and a.speedup_claim == "supported"
    assert a.line.startswith("AMP engaged: 100.0 %")


class Float64Head(nn.Module):
    """A forward whose big matmul autocast never sees: done in float64, or inside ``autocast(enabled=False)``;
    a small Linear after it is autocast's."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(64, 64) / 8)
        self.head = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "float64":
            h = (x.double() @ self.w.double()).float()
        else:
            with torch.autocast(x.device.type, enabled=False):
                h = x.float() @ self.w
        return self.head(torch.relu(h))


@pytest.mark.parametrize("how, wide", [("float64", "float64"), ("autocast_disabled", "float32")])
def test_matmul_outside_autocast_is_flagged_and_named(how, wide):
    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randint(0, 2, (32,))
    a = audit(Float64Head(how), x, y, F.cross_entropy, Policy(dtype="bfloat16"), CPU)
    big = 2 * mm(32, 64, 64)  # forward and the weight gradient (x needs none)
    head = 3 * mm(32, 64, 2)  # forward, input and weight gradients
    assert a.total.flops == big + head
    assert a.total.reduced_share == pytest.approx(head / (big + head))  # 4.5 %: below the 10 % line
    assert a.flagged and a.speedup_claim == "unsupported"
    assert "AMP did not engage" in a.line and "speedup claim unsupported" in a.line
    top = a.stayed_fp32[0]
    assert (top.module, top.module_type, top.precision, top.by_policy) == ("", "Float64Head", wide, False)
    assert top.shapes == ((32, 64), (64, 64)) and top.share == pytest.approx(mm(32, 64, 64) / (big + head))
    assert sum(o.share for o in a.stayed_fp32) == pytest.approx(big / (big + head))
    assert {(o.module, o.precision) for o in a.stayed_fp32} == {("", wide)}  # its backward too, not head's


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def test_conv_kept_in_fp32_by_policy_leaves_exactly_the_linear_share():
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 3])
    a = audit(ConvNet(), x, y, F.cross_entropy, Policy(dtype="float16", fp32_modules=("conv",)), CPU)
    conv = 2 * (2 * 8 * 6 * 6) * (3 * 3 * 3)  # output elements x kernel x in-channels; forward and weight gradient
    linear = mm(2, 288, 4)  # forward, input and weight gradients
    assert a.by_category["convolution"].flops == 2 * conv and a.by_category["matmul"].flops == 3 * linear
    assert a.total.reduced_share == 3 * linear / (2 * conv + 3 * linear) == 13824 / 76032  # 18.2 %
    assert a.by_category["convolution"].reduced_share == 0.0 and a.by_category["matmul"].reduced_share == 1.0
    assert a.stayed_fp32 == ()  # nothing silent: the policy asked for it
    assert {(o.module, o.phase, o.precision, o.by_policy) for o in a.kept_fp32} == {
        ("conv", "forward", "float32", True),
        ("conv", "backward", "float32", True),
    }
    assert not a.flagged and "kept in FP32 by fp32_modules ['conv']: 81.8 %" in a.line


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, 2, 8).permute(2, 0, 3, 1, 4)  # 2 heads of 8
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, length, 16)).mean(1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_scaled_dot_product_attention_is_counted_and_reduced(dtype):
    torch.manual_seed(0)
    x, y = torch.randn(2, 5, 16), torch.tensor([1, 2])
    a = audit(Attention(), x, y, F.cross_entropy, Policy(dtype=dtype), CPU)
    assert a.by_category["attention"].reduced_share == 1.0 and a.total.reduced_share == 1.0
    attention_forward = a.by_phase["forward"].flops - mm(10, 16, 48) - mm(10, 16, 4)
    assert attention_forward == 4 * 2 * 2 * 5 * 5 * 8  # 4*B*H*L*S*E
    assert not a.flagged


def test_model_already_cast_to_bf16_gains_nothing_over_its_reference():
    model = mlp().to(torch.bfloat16)
    x, y = torch.randn(4, 8, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 0])
    a = audit(model, x, y, F.cross_entropy, Policy(dtype="bfloat16"), CPU)
    assert a.total.reduced_share == 1.0 and a.reference_reduced_share == 1.0
    assert a.flagged and a.speedup_claim == "unsupported" and "already runs 100.0 %" in a.line


def test_fp32_policy_is_not_a_precision_claim():
    a = audit(mlp(), torch.randn(4, 8), torch.tensor([0, 1, 2, 0]), F.cross_entropy, Policy(compile="inductor"), CPU)
    assert a.total.reduced_share == 0.0 and not a.flagged and a.speedup_claim == "not a precision claim"
    assert len(a.stayed_fp32) == 5 and a.policy["compile"] == "inductor"


@pytest.mark.parametrize("recipe, share", [("tensorwise", 1.0), ("rowwise_with_gw_hp", 2 / 3)])
def test_float8_matmuls_count_as_reduced_emulated(recipe, share):
    torchao_float8 = import_or_skip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    torchao_float8.convert_to_float8_training(model, config=config)
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    a = audit(model, x, y, F.cross_entropy, Policy(float8=recipe), CPU)
    assert a.total.flops == 3 * mm(16, 32, 64) + 3 * mm(16, 64, 16)  # torchao computes layer 0's input gradient too
    assert a.total.reduced_share == pytest.approx(share) and a.reference_reduced_share is None
    assert set(a.by_precision) == ({"float8"} if share == 1.0 else {"float8", "float32"})
    assert not a.flagged  # the high-precision weight gradients are a third: the recipe's choice, and said
    if share < 1.0:
        assert {o.phase for o in a.stayed_fp32} == {"backward"} and all(o.op == "aten.mm.default" for o in a.stayed_fp32)


def test_audit_file_reads_back_key_for_key(tmp_path):
    a = audit(ConvNet(), torch.randn(2, 3, 8, 8), torch.tensor([0, 3]), F.cross_entropy,
              Policy(dtype="float16", fp32_modules=("conv",)), CPU)
    audit_file.write(tmp_path, a)
    assert audit_file.read(tmp_path) == a
    (tmp_path / audit_file.FILE).write_text('{"total": {}}')
    with pytest.raises(UserError, match="is not an audit of this version; rebuild it with `dvc repro diagnose@x`"):
        audit_file.read(tmp_path, "diagnose@x")


def test_fsdp2s_mixed_precision_is_a_precision_claim_the_amp_share_judges() -> None:
    """A policy casting parameters through FSDP2 (fsdp_param_dtype) claims reduced precision as autocast does: the audit
    expects it, and the rule's min_amp_share applies, named by what ran (not "FP32 by design")."""
    from pipeline import rule
    from pipeline.config import AcceptanceConfig, Policy
    from pipeline.diagnosis import audit as auditing

    mixed = auditing._audit([], Policy(dtype="float32", fsdp_param_dtype="bfloat16"), 1, None, 0.1)
    assert mixed.expects_reduced and mixed.speedup_claim == "unsupported"  # no FLOPs seen: nothing gained
    line = rule.amp_share(mixed, AcceptanceConfig())
    assert line is not None and "FP32 by design" not in line
    assert not auditing._audit([], Policy(), 1, None, 0.1).expects_reduced  # FP32: no claim


def test_fsdp2s_mixed_precision_gains_over_its_fp32_reference_traced_uncast() -> None:
    """The audit casts the FP32 model itself for FSDP2's mixed precision and traces the reference uncast: a healthy
    bfloat16-parameter run engages on every matmul against a reference that runs none (it read 100 % "already reduced"
    and flagged the variant, "nothing to gain", when the trial handed it the cast copy for both passes)."""
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    a = audit(mlp(), x, y, F.cross_entropy, Policy(dtype="float32", fsdp_param_dtype="bfloat16"), CPU)
    assert a.by_precision == {"bfloat16": 3200} and a.reference_reduced_share == 0.0
    assert not a.flagged and a.speedup_claim == "supported" and a.line.startswith("AMP engaged: 100.0 %")
