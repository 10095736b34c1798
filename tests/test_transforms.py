"""pipeline.transforms on the CPU: real torchao float8 (emulated casts) and real inductor (gcc), on tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import checkpoint, transforms
from pipeline.config import Policy
from pipeline.errors import UserError

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
OLD_TORCH = not transforms.float8_torch()
needs_float8 = pytest.mark.skipif(OLD_TORCH, reason="torchao 0.18's float8 needs torch >= 2.11 (transforms refuses older: "
                                                    "test_float8_on_an_older_torch_is_one_line)")


def _model(*dims: tuple[int, int]) -> torch.nn.Sequential:
    """Linear layers of the given (in, out) with a ReLU between each two, from a fixed seed."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, o in dims:
        layers += [torch.nn.ReLU(), torch.nn.Linear(i, o)] if layers else [torch.nn.Linear(i, o)]
    return torch.nn.Sequential(*layers)


def _eager_and_applied(policy: Policy, *dims: tuple[int, int]) -> tuple[torch.nn.Module, transforms.Applied]:
    return _model(*dims), transforms.apply(_model(*dims), policy, CPU)


def _train(model: torch.nn.Module, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps under bf16 autocast (float8 runs under it, as torchtitan does)."""
    torch.manual_seed(1)
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@needs_float8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_emulated_on_cpu_changes_numerics_close_to_eager_same_parameters(recipe: str) -> None:
    eager, applied = _eager_and_applied(Policy(dtype="bfloat16", float8=recipe), (32, 32), (32, 32), (32, 32))
    assert (applied.float8, applied.float8_kernels, applied.compiled) == (recipe, "emulated", False)
    assert applied.float8_linears == ("0", "2", "4") and applied.float8_skipped == ()
    assert applied.model is applied.module
    assert {type(m).__name__ for m in applied.module if not isinstance(m, torch.nn.ReLU)} == {"Float8Linear"}
    # Dynamic scaling: no float8 state, the eager model's keys and values, Parameters still Parameters.
    assert list(applied.module.state_dict()) == list(eager.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(applied.module.state_dict().values(), eager.state_dict().values()))
    assert list(applied.module.buffers()) == []
    assert all(type(p) is torch.nn.Parameter for p in applied.module.parameters())
    x = torch.randn(16, 32)
    with torch.no_grad():
        ref, out = eager(x), applied.model(x)
    err = (out - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.1, f"float8 {recipe}: relative error {err}"


@needs_float8
def test_float8_trains_and_checkpoints_with_the_eager_keys(tmp_path: Path) -> None:
    eager, applied = _eager_and_applied(Policy(dtype="bfloat16", float8="tensorwise"), (32, 32), (32, 32))
    params = list(applied.module.parameters())
    losses = _train(applied.model, 8)
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(p is q for p, q in zip(params, applied.module.parameters()))
    opt = torch.optim.AdamW(applied.module.parameters())
    saved = checkpoint.capture(applied.module, opt)
    assert [k for k in saved.tensors if k.startswith("model/")] == [f"model/{k}" for k in eager.state_dict()]
    checkpoint.save(tmp_path / "f8.safetensors", saved)
    again = transforms.apply(_model((32, 32), (32, 32)), Policy(dtype="bfloat16", float8="tensorwise"), CPU)
    checkpoint.restore(checkpoint.load(tmp_path / "f8.safetensors"), again.module, rng=False)
    x = torch.randn(8, 32)
    with torch.no_grad():
        assert torch.equal(again.model(x), applied.model(x))


@needs_float8
def test_float8_skips_what_it_cannot_take_and_says_why() -> None:
    policy = Policy(dtype="bfloat16", float8="tensorwise", fp32_modules=("2",))
    _, applied = _eager_and_applied(policy, (32, 32), (32, 32), (32, 10), (10, 3))
    assert applied.float8_linears == ("0",)
    assert dict(applied.float8_skipped) == {
        "2": "in fp32_modules",
        "4": "32x10: float8 needs both dims divisible by 16",
        "6": "10x3: float8 needs both dims divisible by 16",
    }
    assert [type(m).__name__ for m in applied.module][::2] == ["Float8Linear", "Linear", "Linear", "Linear"]
    assert applied.as_dict() == {
        "float8": "tensorwise",
        "float8_kernels": "emulated",
        "float8_linears": ["0"],
        "float8_skipped": dict(applied.float8_skipped),
    }


@needs_float8
def test_float8_leaves_multihead_attention_out_proj_which_it_would_never_call() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(32, 2), "head": torch.nn.Linear(32, 32)})
    applied = transforms.apply(model, Policy(float8="tensorwise"), CPU)
    assert applied.float8_linears == ("head",)
    assert [name for name, _ in applied.float8_skipped] == ["attn.out_proj"]
    assert type(model["attn"].out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear


@needs_float8
def test_float8_with_no_eligible_linear_is_one_line() -> None:
    with pytest.raises(UserError, match=r"^float8: rowwise found no linear layer it can convert \(0: 10x3: .*float8: off") as exc:
        transforms.apply(_model((10, 3)), Policy(float8="rowwise"), CPU)
    assert "\n" not in str(exc.value)


@pytest.mark.skipif(not OLD_TORCH, reason="this torch runs torchao 0.18's float8")
def test_float8_on_an_older_torch_is_one_line() -> None:
    with pytest.raises(UserError, match=r"^float8 needs torch >= 2\.11 \(torchao 0\.18\), not .*set float8: off$") as exc:
        transforms.apply(_model((32, 32)), Policy(float8="tensorwise"), CPU)
    assert "\n" not in str(exc.value)


def test_eager_autocast_policy_changes_nothing() -> None:
    model = _model((32, 32))
    applied = transforms.apply(model, Policy(dtype="float16"), CPU)
    assert applied.model is model and applied.module is model and applied.as_dict() == {}
    assert transforms.float8_kernels_available(CPU) is False


def test_missing_torchao_and_missing_compiler_are_one_line_each() -> None:
    """A subprocess: torchao blocked by ``sys.modules``, and $CXX (which inductor reads at import) unfindable."""
    code = (
        "import sys; sys.modules['torchao'] = None\n"
        "import torch\n"
        "from pipeline import transforms\nfrom pipeline.config import Policy\nfrom pipeline.errors import UserError\n"
        "for policy in (Policy(float8='tensorwise'), Policy(compile='inductor')):\n"
        "    try:\n"
        "        transforms.apply(torch.nn.Linear(32, 32), policy, torch.device('cpu'))\n"
        "    except UserError as exc:\n"
        "        print(exc)\n"
    )
    env = {**os.environ, "CXX": "no-such-c++"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        f"float8 needs torch >= 2.11 (torchao 0.18), not {torch.__version__}; upgrade torch or set float8: off" if OLD_TORCH
        else "float8 needs torchao, which is not installed: pip install 'amp-validation[fp8]', or set float8: off",
        "compile: inductor on the CPU needs a C++ compiler and no-such-c++ was not found; "
        "install one (apt-get install g++), point $CXX at one, or set compile: off",
    ]


@pytest.mark.integration  # inductor generates and builds C++: ~5-15 s on 2 shared cores
def test_compiled_matches_eager_keeps_eager_keys_and_times_its_compile() -> None:
    eager, applied = _eager_and_applied(Policy(compile="inductor"), (32, 32), (32, 32))
    assert applied.compiled and applied.as_dict() == {"compiled": True}
    assert applied.model is not applied.module
    # torch.compile's wrapper prefixes every key: the reason Applied keeps the uncompiled module.
    assert list(applied.model.state_dict()) == [f"_orig_mod.{k}" for k in eager.state_dict()]
    assert list(applied.module.state_dict()) == list(eager.state_dict())
    assert all(p is q for p, q in zip(applied.model.parameters(), applied.module.parameters()))
    x = torch.randn(16, 32)

    def step() -> None:
        applied.model(x).square().sum().backward()

    compile_s = transforms.compile_seconds(step, CPU, steady_steps=3)
    assert compile_s > 0.5, f"the first call compiles: {compile_s} s"
    ref = eager(x)
    ref.square().sum().backward()
    torch.testing.assert_close(applied.model(x), ref, rtol=1e-5, atol=1e-6)
    grads = [p.grad / 4 for p in applied.module.parameters()]  # 1 + 3 steady steps accumulated
    torch.testing.assert_close(grads, [p.grad for p in eager.parameters()], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_on_a_gpu_float8_runs_real_kernels_from_capability_8_9_and_compile_matches_eager() -> None:
    """The GPU CI's check of the two variants beyond autocast: which float8 kernels ran (real on Ada/Hopper and
    newer, emulated below), a float8 step that trains, and an inductor-compiled bf16 forward close to eager."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).to(device)
    x = torch.randn(32, 64, device=device)
    float8 = Policy(dtype="bfloat16", float8="tensorwise")
    if OLD_TORCH:  # the ROCm image's torch
        with pytest.raises(UserError, match="float8 needs torch"):
            transforms.apply(model, float8, device)
    else:
        applied = transforms.apply(model, float8, device)
        assert applied.float8_kernels == ("real" if transforms.float8_kernels_available(device) else "emulated")
        if not torch.version.hip:
            assert (applied.float8_kernels == "real") == (torch.cuda.get_device_capability(device) >= (8, 9))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = applied.model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
    eager = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
    compiled = transforms.apply(eager, Policy(dtype="bfloat16", compile="inductor"), device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.allclose(compiled.model(x).float(), eager(x).float(), atol=0.05, rtol=0.05)
