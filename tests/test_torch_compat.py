"""The oldest torch the pipeline runs on (2.4, pyproject.toml) next to the newest: what it asks of torch is asked of the
feature, not of the version. CI runs these on torch 2.13; scripts/oldest_torch.sh runs them (and the fast lane) on 2.4.1,
where some of them take the other branch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline import devices, distributed, precision, torch_compat
from pipeline.config import Policy

CPU = torch.device("cpu")


def _one_rank_fsdp2_step_on_cpu(tmp_path) -> BaseException | None:
    """One forward and backward of a fully_shard-ed module in a one-rank gloo group on a CPU mesh (in this process;
    the group is gone after); the exception it raised, or None."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, _ = distributed.fsdp_api()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))  # not the default mesh: that is CUDA's wherever a GPU is visible
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.ones(2, 4)).sum().backward()
        return None
    except Exception as exc:  # torch 2.4: RuntimeError from torch.cuda.Stream; 2.5: "FSDP requires CUDA for streams"
        return exc
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_the_cpu_is_told_by_the_feature_check(tmp_path):
    """torch_compat.fsdp2_runs_on_cpu says what FSDP2 does: it trains on the CPU (torch 2.6 and later) or fails at its
    first forward, making CUDA streams (torch 2.4, 2.5)."""
    if not torch.distributed.is_available():
        pytest.skip("this torch is built without torch.distributed")
    raised = _one_rank_fsdp2_step_on_cpu(tmp_path)
    assert torch_compat.fsdp2_runs_on_cpu() == (raised is None), repr(raised)


def test_fsdp_api_gives_fully_shard_and_the_mixed_precision_fields_the_pipeline_sets():
    """torch.distributed.fsdp since torch 2.6, torch.distributed._composable.fsdp in 2.4 and 2.5: either way the
    MixedPrecisionPolicy takes what precision.fsdp_mixed_precision passes."""
    if not torch.distributed.is_available():
        pytest.skip("this torch is built without torch.distributed")
    fully_shard, policy = distributed.fsdp_api()
    assert callable(fully_shard)
    block, root = precision.fsdp_mixed_precision(Policy(dtype="float32", fsdp_param_dtype="bfloat16"))
    assert set(block) | set(root) <= {f.name for f in dataclasses.fields(policy)}
    assert policy(**root).output_dtype == torch.float32


def test_an_op_without_a_reduced_precision_kernel_is_read_as_missing_on_either_torch():
    """Newer torch raises NotImplementedError for a dtype an op has no kernel for; torch 2.4 a RuntimeError "... not
    implemented for 'Half'". devices.missing_kernel reads both as a missing kernel, so a failed trial says which."""
    x = torch.randn(4, 8)
    with pytest.raises((NotImplementedError, RuntimeError)) as raised, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.special.bessel_j0(torch.nn.functional.linear(x, torch.randn(8, 8)))
    assert devices.missing_kernel(raised.value)
    assert devices.missing_kernel(RuntimeError('"bessel_j0_cpu" not implemented for \'BFloat16\''))  # torch 2.4's words
    assert devices.missing_kernel(NotImplementedError('"bessel_j0_cpu" not implemented for \'BFloat16\''))
    assert not devices.missing_kernel(RuntimeError("value cannot be converted to type at::Half without overflow"))


def test_the_grad_scaler_is_torch_amps_on_the_cpu_and_its_state_round_trips():
    """precision.make_scaler: torch.amp.GradScaler(device.type), which takes "cpu" since torch 2.3 (torch.cuda.amp's
    older one is CUDA only)."""
    scaler = precision.make_scaler(Policy(dtype="float16"), CPU)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    again = torch.amp.GradScaler("cpu")
    again.load_state_dict(scaler.state_dict())
    assert again.get_scale() == scaler.get_scale() == 65536.0
