"""The training loop: recipe order, accumulation, real updates under forced overflows, schedule on real updates, the data
order, Datasets, the fault-injection hook and resume."""

import dataclasses

import pytest
import torch

from pipeline import checkpoint, training
from pipeline.config import LrSchedule, ReferenceConfig, TaskConfig
from pipeline.config import Policy
from pipeline.errors import UserError
from pipeline.task import Batch, DatasetSource, TensorSource

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


def test_accumulation_unscales_once_per_update_and_matches_the_mean_gradient(monkeypatch):
    calls = []
    original = torch.amp.GradScaler.unscale_
    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", lambda self, opt: (calls.append(1), original(self, opt))[1])
    source = data()
    x, y = source.x, source.y
    c = cfg(train_steps=3, batch_size=8, grad_accumulation=2, optimizer="sgd", momentum=0.0, grad_clip=None)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    manual = torch.nn.Linear(8, 4)
    manual.load_state_dict(model.state_dict())
    result = training.train(model, source, c, TASK, Policy(dtype="float16"), CPU, seed=0)
    assert len(calls) == 3 and len(result.records) == 3
    for micro in training.update_batches(64, c, seed=0):
        manual.zero_grad()
        for idx in micro:
            (torch.nn.functional.cross_entropy(manual(x[idx]), y[idx]) / 2).backward()
        with torch.no_grad():
            for p in manual.parameters():
                p -= 0.01 * p.grad
    for a, b in zip(model.parameters(), manual.parameters()):
        assert torch.allclose(a, b, atol=2e-3)  # float16 forward against an FP32 hand-made loop


class Items(torch.utils.data.Dataset):
    """A map-style Dataset over the same samples, item by item, dict items with the target under 'labels'."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class DictModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


def test_a_dataset_trains_exactly_as_the_same_tensors():
    source = data()
    x, y = source.x, source.y
    c = cfg(train_steps=6, batch_size=8, grad_accumulation=2)
    torch.manual_seed(0)
    from_tensors = training.train(DictModel(), TensorSource(Batch({"x": x}), y), c, TASK, Policy(dtype="bfloat16"), CPU, seed=3)
    torch.manual_seed(0)
    items = DatasetSource(Items(x, y), "labels")
    from_dataset = training.train(DictModel(), items, c, TASK, Policy(dtype="bfloat16"), CPU, seed=3)
    assert [repr(r) for r in from_dataset.records] == [repr(r) for r in from_tensors.records]
    assert items.fingerprint() == DatasetSource(Items(x, y), "labels").fingerprint()
    assert items.fingerprint() != DatasetSource(Items(x + 1, y), "labels").fingerprint()


def test_the_noise_replicate_order_swaps_one_sample_per_pair_of_updates():
    order = training.update_batches(64, ReferenceConfig(train_steps=5, batch_size=8, grad_accumulation=1), seed=0)
    swapped = training.neighbours_swapped(order)
    for s in range(5):
        a, b = order[s][0], swapped[s][0]
        assert torch.equal(a[1:], b[1:])  # the rest of every micro-batch as it was
    assert swapped[0][0][0] == order[1][0][0] and swapped[1][0][0] == order[0][0][0]
    assert torch.equal(swapped[4][0], order[4][0])  # an odd last update keeps its batch
    assert sorted(torch.cat([b[0] for b in swapped]).tolist()) == sorted(torch.cat([b[0] for b in order]).tolist())


def test_the_noise_replicate_trades_one_sample_per_64_of_a_large_update_across_its_micro_batches():
    """At 2 x 320 samples an update (two micro-batches), 10 samples trade places per pair of updates, the first ones in
    micro-batch order: the replicate moves as much at any batch size as the default example's one sample in 64."""
    order = training.update_batches(4000, ReferenceConfig(train_steps=3, batch_size=320, grad_accumulation=2), seed=0)
    swapped = training.neighbours_swapped(order)
    first, second = (torch.cat(step) for step in order[:2])
    a, b = (torch.cat(step) for step in swapped[:2])
    assert torch.equal(a[:10], second[:10]) and torch.equal(b[:10], first[:10])
    assert torch.equal(a[10:], first[10:]) and torch.equal(b[10:], second[10:])
    assert [t.numel() for t in swapped[0]] == [320, 320] and all(torch.equal(u, v) for u, v in zip(swapped[2], order[2]))


def test_the_a_a_order_differs_from_the_reference_and_the_replicate_with_the_same_samples_and_counts():
    """data_order: swapped (FP32's A/A) trades another block of samples of each pair of updates than the replicate's
    (the first samples): a fresh draw, so that the trial is not the replicate again."""
    c = ReferenceConfig(train_steps=5, batch_size=8, grad_accumulation=1)
    order = training.update_batches(64, c, seed=0)
    replicate = training.neighbours_swapped(order)
    swapped = training.trial_order(64, c, 0, Policy(data_order="swapped"))
    assert [[t.tolist() for t in s] for s in training.trial_order(64, c, 0, Policy())] == [[t.tolist() for t in s] for s in order]
    for s in range(4):
        assert not torch.equal(swapped[s][0], order[s][0]) and not torch.equal(swapped[s][0], replicate[s][0])
    moved = [(swapped[s][0] != order[s][0]).nonzero().flatten().tolist() for s in range(4)]
    assert all(len(m) == 1 and m[0] != 0 for m in moved), moved  # one sample an update, not the replicate's first
    i = moved[0][0]
    assert swapped[0][0][i] == order[1][0][i] and swapped[1][0][i] == order[0][0][i]
    assert (training.neighbours_swapped(order, offset=1)[0][0] != order[0][0]).nonzero().flatten().tolist() == [1]
    assert torch.equal(swapped[4][0], order[4][0])  # an odd last update keeps its batch
    assert [[t.numel() for t in s] for s in swapped] == [[t.numel() for t in s] for s in order]
    assert sorted(torch.cat([b[0] for b in swapped]).tolist()) == sorted(torch.cat([b[0] for b in order]).tolist())


def test_the_a_a_run_checks_the_reference_hashes_only_where_its_batches_are_the_reference_ones():
    """The reference never read a swapped update's batch: those steps go unchecked, the odd last one is checked."""
    source, c, aa = data(), cfg(train_steps=5), Policy(data_order="swapped")
    torch.manual_seed(0)
    ref = training.train(torch.nn.Linear(8, 4), source, c, TASK, Policy(), CPU, seed=0).records
    hashes = [r.batch_sha256 for r in ref]
    torch.manual_seed(0)
    run = training.train(torch.nn.Linear(8, 4), source, c, TASK, aa, CPU, seed=0, expect_batches=hashes).records
    assert [r.batch_sha256 == h for r, h in zip(run, hashes)] == [False] * 4 + [True]
    with pytest.raises(UserError, match="training step 5: the batch read differs"):
        torch.manual_seed(0)
        training.train(torch.nn.Linear(8, 4), source, c, TASK, aa, CPU, seed=0, expect_batches=hashes[:4] + ["0" * 64])


def test_progress_line_names_step_loss_scale_skipped_and_eta():
    p = training.Progress("trial float16", 10)
    line = p.line(4, 1.25, 32768.0, 2, p.t0 + 2.0)
    assert "step 4/10" in line and "loss 1.2500" in line and "scale 32768" in line and "skipped 2" in line and "ETA 3s" in line


def test_a_resume_state_at_the_last_step_or_beyond_is_a_restart_not_a_finished_run(tmp_path, capsys):
    """States are saved before the last step only. A state edited to say step 12 of a 12-step run (its sidecar
    recomputed) was taken as a finished run, its step-4 weights written as the trained model; step 20 crashed. Both
    now cost one warning and a run from step 0 that ends as an uninterrupted one."""
    source = data()
    c = cfg(checkpoint_every=1)
    policy = Policy(dtype="float16")
    torch.manual_seed(0)
    full = training.train(Loud(), source, c, TASK, policy, CPU, seed=0)
    saved = {}

    def keep(ckpt):
        saved.setdefault(ckpt.meta["step"], ckpt)

    training.train(Loud(), source, c, TASK, policy, CPU, seed=0, save_resume=keep)
    early = saved[4]
    for step in (c.train_steps, c.train_steps + 8):
        forged = dataclasses.replace(early, info=dataclasses.replace(early.info, step=step))
        torch.manual_seed(0)
        again = training.train(Loud(), source, c, TASK, policy, CPU, seed=0, resume=forged)
        assert f"the resume state is at step {step} of a {c.train_steps}-step run" in capsys.readouterr().err
        assert [repr(r) for r in again.records] == [repr(r) for r in full.records]


class Counted(torch.nn.Module):
    """Counts the rows it is called on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.rows = 0

    def forward(self, x):
        self.rows += x.shape[0]
        return self.fc(x)


def test_an_inference_only_trial_infers_its_cases_once_and_its_trained_outputs_are_those():
    """``train_steps`` 0: the model trained for no step is the one inferred; an LLM's fixed set is not run twice."""
    torch.manual_seed(0)
    model, cases = Counted(), torch.randn(24, 8)
    initial = []

    def make_initial():
        initial.append(Counted())
        initial[-1].load_state_dict(model.state_dict())
        return initial[-1]

    sunk = {}
    run = training.run_trial(model, make_initial, data(), cases, cfg(train_steps=0), TASK, Policy(dtype="bfloat16"), CPU,
                             seed=0, sink=lambda name, chunks: sunk.update({name: chunks if chunks is None else list(chunks)}))
    assert model.rows + sum(m.rows for m in initial) == 24  # each case once
    assert list(sunk) == ["outputs", "trained_outputs"] and sunk["trained_outputs"] is None  # "the same outputs"
    assert run.training.records == [] and run.aligned is None
    held = training.run_trial(model, make_initial, data(), cases, cfg(train_steps=0), TASK, Policy(dtype="bfloat16"), CPU, seed=0)
    assert held.trained_outputs is held.outputs
