"""checkpoint.start / continue_optimizer / continue_schedule (issue 52 item 2): the state a run starts from when
``reference.checkpoint`` names a user's file, on a real model, real optimizers and real safetensors files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pipeline import checkpoint
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
