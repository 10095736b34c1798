"""The training loop: recipe order, real updates under forced overflows, schedule on real updates, resume."""

import dataclasses

import pytest
import torch

from pipeline import checkpoint, training
from pipeline.config import LrSchedule, ReferenceConfig, TaskConfig
from pipeline.precision import Policy
from pipeline.task import TensorSource

CPU = torch.device("cpu")
TASK = TaskConfig()  # classification, cross_entropy


class Loud(torch.nn.Module):
    """Gradients through the x1000 overflow FP16 at GradScaler's initial scale (65536): forced skips."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) * 1000.0


def data(n=64, seed=0) -> TensorSource:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) * 0.01
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorSource(x, y)


def cfg(**kw):
    return dataclasses.replace(ReferenceConfig(train_steps=16, batch_size=16, lr=0.01, grad_clip=1.0, checkpoint_every=0), **kw)


def test_forced_overflows_are_skipped_and_not_counted_as_updates():
    torch.manual_seed(0)
    model = Loud()
    source = data()
    result = training.train(model, source, cfg(), TASK, Policy(dtype="float16"), CPU, seed=0)
    skipped = [r.skipped for r in result.records]
    assert any(skipped), "the x1000 model must overflow FP16 at the initial scale"
    assert result.real_updates == len(skipped) - sum(skipped)
    # Each skip halves the scale (GradScaler backoff), each real update keeps it (growth needs 2000 steps).
    for before, after in zip(result.records, result.records[1:]):
        assert after.scale == (before.scale / 2 if before.skipped else before.scale)


def test_schedule_follows_real_updates_under_forced_overflows():
    torch.manual_seed(0)
    model = Loud()
    source = data()
    c = cfg(lr_schedule=LrSchedule(kind="step", every=2, gamma=0.5))
    result = training.train(model, source, c, TASK, Policy(dtype="float16"), CPU, seed=0)
    assert sum(r.skipped for r in result.records) >= 3
    for r in result.records:
        # lr recorded after the step: decays once per 2 REAL updates, whatever the iteration count.
        assert r.lr == pytest.approx(0.01 * 0.5 ** (r.real_updates // 2))
    iteration_driven = 0.01 * 0.5 ** (len(result.records) // 2)
    assert result.records[-1].lr != pytest.approx(iteration_driven)


def test_bfloat16_uses_no_scaler_and_fp32_reference_is_unchanged_by_policy_code():
    source = data()
    torch.manual_seed(0)
    bf = training.train(Loud(), source, cfg(), TASK, Policy(dtype="bfloat16"), CPU, seed=0)
    assert all(r.scale == 1.0 and not r.skipped for r in bf.records)
    assert bf.state.meta["grad_scaler"] == {}
    torch.manual_seed(0)
    ref = training.train(Loud(), source, cfg(), TASK, Policy(), CPU, seed=0)
    losses_bf = [r.loss for r in bf.records]
    assert [r.loss for r in ref.records] != losses_bf  # autocast really changed the arithmetic


def test_batch_order_is_fixed_by_seed_and_covers_epochs():
    a = training.batch_order(10, 4, 6, seed=3)
    assert [t.tolist() for t in a] == [t.tolist() for t in training.batch_order(10, 4, 6, seed=3)]
    assert [t.tolist() for t in a] != [t.tolist() for t in training.batch_order(10, 4, 6, seed=4)]
    assert all(len(t) == 4 for t in a)
    assert len(set(torch.cat(a[:2]).tolist())) == 8  # no repeats within an epoch


@pytest.mark.parametrize("stop_at", [3, 8, 13])
def test_resume_from_checkpoint_file_is_bit_identical(tmp_path, stop_at):
    source = data()
    c = cfg(checkpoint_every=1, lr_schedule=LrSchedule(kind="step", every=3, gamma=0.5))
    policy = Policy(dtype="float16")

    torch.manual_seed(0)
    full = training.train(Loud(), source, c, TASK, policy, CPU, seed=0)

    saved = {}

    def keep(ckpt):
        if ckpt.meta["step"] == stop_at:
            saved["path"] = tmp_path / "resume.safetensors"
            checkpoint.save(saved["path"], ckpt)

    torch.manual_seed(0)
    training.train(Loud(), source, c, TASK, policy, CPU, seed=0, save_resume=keep)
    torch.manual_seed(123)  # a different process state: the checkpoint must carry everything
    resumed = training.train(Loud(), source, c, TASK, policy, CPU, seed=0, resume=checkpoint.load(saved["path"]))

    assert [repr(r) for r in resumed.records] == [repr(r) for r in full.records]  # repr: NaN == NaN here
    assert resumed.state.meta["grad_scaler"] == full.state.meta["grad_scaler"]
    for key, value in full.state.tensors.items():
        assert torch.equal(resumed.state.tensors[key], value), key
    assert checkpoint.save(tmp_path / "a.safetensors", full.state) == checkpoint.save(tmp_path / "b.safetensors", resumed.state)


def test_on_step_runs_after_each_step_once_its_resume_state_is_saved_and_a_crash_there_resumes_exactly():
    """The fault-injection hook's contract: the kill tests stop a stage inside ``on_step`` and expect the
    state of that step on disk when the step is a multiple of ``checkpoint_every``."""
    source = data()
    c = cfg(checkpoint_every=4)
    policy = Policy(dtype="float16")
    torch.manual_seed(0)
    full = training.train(Loud(), source, c, TASK, policy, CPU, seed=0)

    class Crash(Exception):
        pass

    saved: list[checkpoint.Checkpoint] = []
    seen: list[tuple[int, list[int]]] = []

    def crash_after_10(step: int) -> None:
        seen.append((step, [s.meta["step"] for s in saved]))
        if step == 10:
            raise Crash

    torch.manual_seed(0)
    with pytest.raises(Crash):
        training.train(Loud(), source, c, TASK, policy, CPU, seed=0, save_resume=saved.append, on_step=crash_after_10)
    assert [step for step, _ in seen] == list(range(1, 11))
    assert dict(seen)[8] == [4, 8] and dict(seen)[7] == [4]  # step 8's state is saved before the hook runs
    resumed = training.train(Loud(), source, c, TASK, policy, CPU, seed=0, resume=saved[-1])
    assert [repr(r) for r in resumed.records] == [repr(r) for r in full.records]
