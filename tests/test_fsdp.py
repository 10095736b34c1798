"""FSDP2 (``distributed.strategy: fsdp``) inside the ranks, on the CPU for real: 2 gloo ranks spawned by
torch.multiprocessing, ``fully_shard`` on real modules, the GradScaler's skips, the gathered state's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline import checkpoint, distributed, torch_compat
from pipeline.errors import UserError


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


class Net(torch.nn.Module):
    """An embedding tied to the head (one parameter, two owners), two blocks, a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 6)
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 4)
        self.head.weight = torch.nn.Parameter(self.embed.weight.t().contiguous())  # its own, so far
        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))))


def test_blocks_are_the_named_classes_children_first_or_the_top_level_children():
    net = Net()
    assert distributed.shard_blocks(net, ["Block"]) == [net.blocks[1], net.blocks[0]]
    assert distributed.shard_blocks(net, ["Block", "Sequential"]) == [net.blocks[1], net.blocks[0], net.blocks]
    assert distributed.shard_blocks(net, []) == [net.head, net.norm, net.blocks, net.embed]  # not act: no parameters
    net.head.weight = net.embed.weight  # tied: neither is a block of its own, both stay with the root
    assert distributed.shard_blocks(net, []) == [net.norm, net.blocks]
    with pytest.raises(UserError, match=r"fsdp_blocks names 'Layer', no class of the model's modules; use some of .*Block"):
        distributed.shard_blocks(net, ["Layer"])


def every_block(model) -> list:
    """A user's block function (``distributed.fsdp_blocks: [test_fsdp:every_block]``)."""
    return [model.blocks[0], model.blocks[1]]


def outside(model) -> list:
    return [torch.nn.Linear(2, 2)]


def whole(model):
    return model


def container(model) -> list:
    return [model.layers]


def broken(model) -> list:
    return [model.missing]


def test_blocks_a_users_function_returns_are_sharded_children_first_and_anything_else_is_one_line():
    net = Net()
    assert distributed.shard_blocks(net, ["test_fsdp:every_block"]) == [net.blocks[1], net.blocks[0]]
    with pytest.raises(UserError, match=r"returned a module outside the model; return a list of the model's submodules"):
        distributed.shard_blocks(net, ["test_fsdp:outside"])
    with pytest.raises(UserError, match=r"returned Net; return a list"):
        distributed.shard_blocks(net, ["test_fsdp:whole"])  # not a list
    listed = torch.nn.Sequential()
    listed.layers = torch.nn.ModuleList([Block(), Block()])
    with pytest.raises(UserError, match=r"returned a container that is never called \(ModuleList\); return its items"):
        distributed.shard_blocks(listed, ["test_fsdp:container"])
    with pytest.raises(UserError, match=r"'test_fsdp:broken' raised AttributeError: .*missing.*; fix that function"):
        distributed.shard_blocks(net, ["test_fsdp:broken"])
    with pytest.raises(UserError, match=r"fsdp_blocks 'test_fsdp:nothing': test_fsdp has no function 'nothing'"):
        distributed.shard_blocks(net, ["test_fsdp:nothing"])


def _rank(rank: int, rendezvous: str, out: str, strategy: str) -> None:
    import torch.distributed as dist

    from pipeline import precision, recipe, training
    from pipeline.config import Policy, TaskConfig

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    world = distributed.World(rank=rank, size=2, backend="gloo", strategy=strategy)
    distributed._WORLD[0] = world
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = Net()
    trainee = world.sharded_copy(model, torch.device("cpu"))
    net = trainee if world.sharded else world.wrap(trainee, cpu)
    optimizer = torch.optim.AdamW(trainee.parameters(), lr=0.01)
    policy = Policy(dtype="float16")
    scaler = precision.make_scaler(policy, cpu)
    loss_fn = recipe.make_loss(TaskConfig())
    y = torch.tensor([0, 1])
    steps = []
    for step in range(3):
        x = torch.ones(2, 4) * (step + 1)
        if rank == 1 and step == 1:
            x[0, 0] = 1e5  # beyond float16's 65504: only rank 1's own gradients overflow
        done = training.amp_step(net, [(x, y)], loss_fn, optimizer, scaler, policy, cpu)
        steps.append({"skipped": done.skipped, "grad_norm": float(done.grad_norm), "scale": scaler.get_scale()})
    snap = training._snapshot(trainee, optimizer, scaler, None, [], 2, 3, policy, world)
    if rank == 0:
        checkpoint.save(Path(out) / "state.safetensors", snap)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(steps))
    if world.sharded:  # the gathered state goes back into fresh shards and gathers to the same bytes
        torch.manual_seed(1)
        again = world.sharded_copy(Net(), torch.device("cpu"))
        opt2 = torch.optim.AdamW(again.parameters(), lr=0.01)
        saved = checkpoint.load(Path(out) / "state.safetensors") if _wait(Path(out) / "state.safetensors") else None
        checkpoint.restore(saved, again, opt2, rng=False, load=world.load_full_state(again, opt2))
        snap2 = training._snapshot(again, opt2, scaler, None, [], 2, 3, policy, world)
        third = world.sharded_copy(Net(), torch.device("cpu"))  # reference.checkpoint: its optimizer state, continued
        opt3 = torch.optim.AdamW(third.parameters(), lr=0.5)
        checkpoint.continue_optimizer(saved, opt3, "adamw", world.load_full_state(third, opt3))
        snap3 = training._snapshot(third, opt3, None, None, [], 2, 3, policy, world)
        if rank == 0:
            checkpoint.save(Path(out) / "again.safetensors", snap2)
            checkpoint.save(Path(out) / "continued.safetensors", snap3)
    dist.barrier()
    dist.destroy_process_group()


def _wait(path: Path) -> bool:
    import torch.distributed as dist

    dist.barrier()  # rank 0 has written it
    return path.is_file()


def _spawn(tmp_path: Path, strategy: str) -> list:
    import torch.multiprocessing as mp

    tmp_path.mkdir()
    mp.spawn(_rank, args=(str(tmp_path / "rdv"), str(tmp_path), strategy), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.integration  # two processes, twice (20 s)
@pytest.mark.skipif(not torch_compat.fsdp2_runs_on_cpu(), reason="this torch's FSDP2 runs on CUDA only (torch 2.4, 2.5)")
def test_fsdp_skips_on_every_rank_agrees_with_ddp_and_its_gathered_state_reloads_to_the_same_bytes(tmp_path):
    fsdp, ddp = _spawn(tmp_path / "fsdp", "fsdp"), _spawn(tmp_path / "ddp", "ddp")
    assert [s["skipped"] for s in fsdp[0]] == [s["skipped"] for s in fsdp[1]] == [False, True, False]
    assert fsdp[0] == fsdp[1]  # the norm and the scale too: every rank's
    for a, b in zip(fsdp[0], ddp[0]):
        assert a["skipped"] == b["skipped"] and a["scale"] == b["scale"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5) or a["skipped"]
    sharded = checkpoint.load(tmp_path / "fsdp/state.safetensors")
    whole = checkpoint.load(tmp_path / "ddp/state.safetensors")
    assert sharded.tensors.keys() == whole.tensors.keys()  # one format: optimizer state numbered as one process numbers it
    assert sharded.info.optim_param_groups == whole.info.optim_param_groups
    for name, t in whole.tensors.items():
        if not name.startswith("rng/"):
            torch.testing.assert_close(sharded.tensors[name], t, rtol=1e-5, atol=1e-6, msg=name)
    again = checkpoint.load(tmp_path / "fsdp/again.safetensors")
    assert again.info == sharded.info
    for name, t in sharded.tensors.items():
        if not name.startswith("rng/"):  # the RNG is each run's own (reseeded before the reload)
            assert torch.equal(again.tensors[name], t), name
    continued = checkpoint.load(tmp_path / "fsdp/continued.safetensors")
    assert continued.info.optim_param_groups == sharded.info.optim_param_groups  # lr 0.01 as saved, not 0.5
    for name, t in sharded.tensors.items():
        if name.startswith("optim/"):
            assert torch.equal(continued.tensors[name], t), name


def test_fsdp_params_are_checked_at_load(tmp_path):
    from pipeline.config import load_params

    def load(distributed_section: dict):
        import yaml

        raw = yaml.safe_load(Path("params.yaml").read_text())
        raw["distributed"] = {**raw.get("distributed", {}), **distributed_section}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
        return load_params(tmp_path / "params.yaml")

    assert load({}).distributed.strategy == "ddp"
    assert load({"strategy": "fsdp", "fsdp_blocks": ["Block"]}).distributed.fsdp_blocks == ["Block"]
    with pytest.raises(UserError, match=r"distributed.fsdp_blocks is set but distributed.strategy is 'ddp'; set strategy: fsdp"):
        load({"fsdp_blocks": ["Block"]})
    with pytest.raises(UserError, match=r"distributed.strategy"):
        load({"strategy": "zero3"})
    assert load({"strategy": "fsdp", "fsdp_blocks": ["mine.model:blocks"]}).distributed.fsdp_blocks == ["mine.model:blocks"]
    with pytest.raises(UserError, match=r"give class names, or one 'module:function' alone that returns the model's blocks"):
        load({"strategy": "fsdp", "fsdp_blocks": ["Block", "mine.model:blocks"]})


@pytest.mark.parametrize(("policy", "refusal"), [
    ({"dtype": "float32", "fsdp_reduce_dtype": "float32"}, "fsdp_reduce_dtype needs trial.policies.m.fsdp_param_dtype"),
    ({"dtype": "bfloat16", "fsdp_param_dtype": "bfloat16"}, "fsdp_param_dtype is FSDP2's mixed precision, not autocast"),
    ({"dtype": "float32", "fsdp_param_dtype": "float32"}, "fsdp_param_dtype"),
])
def test_fsdp_mixed_precision_policies_are_checked_at_load(tmp_path, policy, refusal):
    import yaml

    from pipeline.config import load_params

    raw = yaml.safe_load(Path("params.yaml").read_text())
    raw["trial"] = {"variants": ["m"], "policies": {"m": policy}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match=refusal):
        load_params(tmp_path / "params.yaml")
    raw["trial"]["policies"]["m"] = {"dtype": "float32", "fsdp_param_dtype": "float16"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    mixed = load_params(tmp_path / "params.yaml").trial.policies["m"]
    assert mixed.uses_scaler and not mixed.amp  # float16 parameters need loss scaling; no autocast runs


def test_param_cast_runs_the_forward_in_the_parameters_dtype_and_returns_float32():
    from pipeline import precision
    from pipeline.config import Policy

    torch.manual_seed(0)
    net = Net()
    cast = precision.param_cast(net, Policy(fsdp_param_dtype="bfloat16"))
    seen = []
    cast.blocks[0].linear.register_forward_hook(lambda _, args, out: seen.append((args[0].dtype, out.dtype)))
    out = cast(torch.ones(2, 4))
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.float32
    assert next(net.parameters()).dtype == torch.float32  # a copy: the model itself is untouched
    assert precision.param_cast(net, Policy()) is net


def test_fsdp_on_the_cpu_where_this_torch_cannot_is_one_line(monkeypatch):
    """torch 2.4 and 2.5 make CUDA streams in FSDP2 whatever the device (pipeline.torch_compat): refused before any
    step, in one line naming the fix, instead of a CUDA error at the first forward."""
    from pipeline import torch_compat

    monkeypatch.setattr(torch_compat, "fsdp2_runs_on_cpu", lambda: False)
    world = distributed.World(rank=0, size=2, backend="gloo", strategy="fsdp")
    with pytest.raises(UserError, match=r"FSDP2 \(.*\) makes CUDA streams whatever the device; use strategy: ddp on the CPU, "
                                        r"or torch 2.6 or later"):
        world.sharded_copy(Net(), torch.device("cpu"))
