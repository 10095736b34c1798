"""checkpoint.start / continue_optimizer / continue_schedule (issue 52 item 2): the state a run starts from when
``reference.checkpoint`` names a user's file, on a real model, real optimizers and real safetensors files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pipeline import checkpoint, dcp
from pipeline.errors import UserError


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def trained_state(optimizer: str = "sgd", enabled_scaler: bool = True) -> checkpoint.Checkpoint:
    """Weights, optimizer and GradScaler state after two real updates, as training captures them."""
    model = net(1)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=0.01))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=enabled_scaler)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return checkpoint.capture(model, opt, scaler, step=2, real_updates=2, records=[{}, {}])


def test_no_checkpoint_is_the_model_as_built():
    model = net()
    init, inputs = checkpoint.start(None, model)
    built = checkpoint.capture(model)
    assert inputs == {} and checkpoint.tensors_digest(init.tensors) == checkpoint.tensors_digest(built.tensors)


def test_a_pipeline_checkpoint_gives_weights_optimizer_and_scaler_but_not_another_runs_counters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no dvc.yaml here: nothing to check the deps against
    saved = trained_state()
    checkpoint.save("ckpt.safetensors", saved)
    model = net()
    init, inputs = checkpoint.start("ckpt.safetensors", model)
    assert inputs == {"ckpt.safetensors": checkpoint.sha256_file("ckpt.safetensors")}
    assert all(torch.equal(v, saved.model_state()[k]) for k, v in model.state_dict().items())
    assert init.info.grad_scaler["scale"] == saved.info.grad_scaler["scale"]
    assert (init.info.step, init.info.records) == (None, None)

    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    checkpoint.continue_optimizer(init, opt, "sgd")
    scaler = torch.amp.GradScaler("cpu")
    checkpoint.continue_schedule(init, scaler, None)
    assert scaler.get_scale() == saved.info.grad_scaler["scale"] and opt.param_groups[0]["lr"] == 0.1
    before = {k: v.clone() for k, v in init.tensors.items() if k.startswith("optim/")}
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # moves the optimizer's momentum in place: never the start's own tensors
    assert all(torch.equal(init.tensors[k], v) for k, v in before.items())


def test_weights_alone_in_another_dtype_load_and_carry_no_optimizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_file({k: v.to(torch.bfloat16) for k, v in net(1).state_dict().items()}, "w.safetensors")
    model = net()
    init, _ = checkpoint.start("w.safetensors", model)
    assert model[0].weight.dtype == torch.float32 and init.info.optim_param_groups is None
    assert not any(k.startswith("optim/") for k in init.tensors)


def test_an_adam_state_for_an_sgd_run_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint.save("adamw.safetensors", trained_state("adamw", enabled_scaler=False))
    model = net()
    init, _ = checkpoint.start("adamw.safetensors", model)
    with pytest.raises(UserError, match="is not a sgd state .* set reference.optimizer"):
        checkpoint.continue_optimizer(init, torch.optim.SGD(model.parameters(), lr=0.1), "sgd")


def test_a_checkpoint_freezes_deps_do_not_list_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_file(net().state_dict(), "w.safetensors")
    (tmp_path / "dvc.yaml").write_text("stages:\n  freeze:\n    cmd: x\n    deps: [pipeline/stages/freeze.py]\n")
    with pytest.raises(UserError, match=r"not in freeze's deps .* add `- w.safetensors` to stages.freeze.deps"):
        checkpoint.start("w.safetensors", net())
    (tmp_path / "dvc.yaml").write_text("stages:\n  freeze:\n    cmd: x\n    deps: [w.safetensors]\n")
    checkpoint.start("w.safetensors", net())


# --- a torch distributed checkpoint's folder (DCP: torch.distributed.checkpoint.save) ----------------------------------

dcp_api = pytest.importorskip("torch.distributed.checkpoint")


def save_dcp(folder, state: dict) -> str:
    """``state`` as ``dcp.save`` writes it in one process (no process group), the folder's path."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp_api.save(state, checkpoint_id=str(folder))
    return str(folder)


def test_a_dcp_folder_gives_weights_and_the_optimizers_state_and_its_digest_covers_every_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = trained_state("adamw", enabled_scaler=False)
    optim = checkpoint._optimizer_state(saved)
    save_dcp("dcp", {"model": saved.model_state(), "optim": optim, "lr_scheduler": {"last_epoch": 3}, "step": 2})
    model = net()
    init, inputs = checkpoint.start("dcp", model)
    assert all(torch.equal(v, saved.model_state()[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(init.tensors[k], v) for k, v in saved.tensors.items() if k.startswith("optim/"))
    assert (init.info.scheduler, init.info.grad_scaler) == ({}, {})  # the saving run's: not kept
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    checkpoint.continue_optimizer(init, opt, "adamw")
    assert opt.param_groups[0]["lr"] == 0.01 and torch.equal(opt.state[model[0].weight]["exp_avg"], optim["state"][0]["exp_avg"])

    save_dcp("app", {"app": {"model": saved.model_state(), "optim": optim}})  # the DCP recipe's AppState layout
    again, _ = checkpoint.start("app", net())
    assert all(torch.equal(again.tensors[k], v) for k, v in init.tensors.items())

    files = {p.name: p.read_bytes() for p in (tmp_path / "dcp").iterdir()}
    assert set(files) == {".metadata", "__0_0.distcp"} and inputs == {"dcp": dcp.folder_digest(files)}
    changed = dict(files, **{"__0_0.distcp": files["__0_0.distcp"][:-1] + bytes([files["__0_0.distcp"][-1] ^ 1])})
    assert dcp.folder_digest(changed) != inputs["dcp"] != dcp.folder_digest({**files, "extra": b""})


def test_a_dcp_folder_of_weights_alone_in_bfloat16_carries_no_optimizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_dcp("w", {k: v.to(torch.bfloat16) for k, v in net(1).state_dict().items()})  # torchtitan: weights at the top
    model = net()
    init, _ = checkpoint.start("w", model)
    assert model[0].weight.dtype == torch.float32 and init.info.optim_param_groups is None
    assert torch.equal(model[2].bias, net(1)[2].bias.to(torch.bfloat16).float())


def _fsdp_rank(rank: int, rendezvous: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    model = net(1)
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    weights, optim = get_state_dict(model, opt)  # the optimizer's state by parameter name, as FSDP2 teams save it
    dcp_api.save({"model": weights, "optim": optim}, checkpoint_id=out)
    dist.destroy_process_group()


def test_an_fsdp2_folder_of_two_ranks_is_put_together_as_dcp_itself_loads_it(tmp_path, monkeypatch):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2")
    torch.multiprocessing.spawn(_fsdp_rank, args=(str(tmp_path / "rdv"), str(tmp_path / "fsdp")), nprocs=2)
    monkeypatch.chdir(tmp_path)
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    model = net()
    init, _ = checkpoint.start("fsdp", model)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _load_state_dict_from_keys(checkpoint_id="fsdp")  # DCP's own reader (it unpickles): our own file
    assert all(torch.equal(v, theirs["model"][k]) for k, v in model.state_dict().items())
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        assert torch.equal(init.tensors[f"optim/{i}/exp_avg"], theirs["optim"]["state"][name]["exp_avg"]), name
    assert init.info.optim_param_groups[0]["params"] == list(range(len(names)))


def test_a_metadata_pickle_that_names_anything_else_is_refused_unrun(tmp_path, monkeypatch):
    import os
    import pickle

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    save_dcp("dcp", {"model": net().state_dict()})
    (tmp_path / "dcp/.metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UserError) as refused:
        checkpoint.start("dcp", net())
    message = str(refused.value)
    assert "dcp/.metadata was refused unread" in message and f"{os.system.__module__}.system" in message
    assert "\n" not in message and not marker.exists()

    from torch.distributed.checkpoint.metadata import Metadata

    (tmp_path / "dcp/.metadata").write_bytes(  # Metadata, then BUILD (None, {"marker": 1}): setattr on the class itself
        b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dVmarker\nI1\nstb.")
    with pytest.raises(UserError, match=r"refused unread \(it sets the state of type .*Metadata"):
        checkpoint.start("dcp", net())
    assert not hasattr(Metadata, "marker")


def test_a_value_that_is_no_plain_data_is_never_run(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    optim = checkpoint._optimizer_state(trained_state(enabled_scaler=False))
    optim["param_groups"][0]["lr"] = Payload()  # dcp.save writes it with torch.save: DCP's own load would run it
    save_dcp("dcp", {"model": net().state_dict(), "optim": optim})
    with pytest.raises(UserError, match=r"'optim' holds values that are not plain data; save optimizer.state_dict"):
        checkpoint.start("dcp", net())
    assert not marker.exists()


def test_chunks_outside_the_folder_and_flattened_optimizers_are_one_line(tmp_path, monkeypatch):
    import pickle

    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict()})
    md = pickle.loads((tmp_path / "dcp/.metadata").read_bytes())  # our own file: a plain load is safe here
    for info in md.storage_data.values():
        info.relative_path = "../secret"
    (tmp_path / "dcp/.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UserError, match=r"is stored in '../secret', no data file of the folder"):
        checkpoint.start("dcp", net())
    md.state_dict_metadata["model.0.weight"].size = torch.Size([10**9, 10**4])  # 40 TB: refused, never allocated
    (tmp_path / "dcp/.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UserError, match=r"'model.0.weight' is \[1000000000, 10000\] torch.float32, more than the folder"):
        checkpoint.start("dcp", net())

    save_dcp("flat", {"model": net().state_dict(), "optimizer": {"state.0.weight.momentum_buffer": torch.zeros(8, 4)}})
    with pytest.raises(UserError, match=r"its 'optimizer' is not an optimizer's state_dict .* or the weights alone"):
        checkpoint.start("flat", net())


def test_a_torch_without_dcps_metadata_classes_is_refused_in_one_line(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import metadata

    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict()})
    monkeypatch.delattr(metadata, "TensorStorageMetadata")  # as an older torch than 2.4 may lack
    with pytest.raises(UserError, match=r"has no TensorStorageMetadata .* use torch 2.4 or later, or load it where"):
        checkpoint.start("dcp", net())
