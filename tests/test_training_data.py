"""Issue 24 item 3: every batch actually read is hashed; the trial and every resume compare the hashes step by step.

A non-deterministic Dataset (an augmentation drawn from the global RNG, a file that changed) used to pass every check:
only items 0, n/2 and n-1 were fingerprinted. Real torch Datasets, real training loops, no mocks.
"""

import pytest
import torch

from pipeline import task, training
from pipeline.config import Policy, ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.task import DatasetSource

CFG = ReferenceConfig(train_steps=6, batch_size=8, lr=0.1, momentum=0.0, checkpoint_every=2, grad_clip=None)
CPU = torch.device("cpu")
TASK = TaskConfig()


class Noisy(torch.utils.data.Dataset):
    """Item i is a fixed sample plus, when ``jitter``, noise from the GLOBAL generator: not a function of i."""

    def __init__(self, jitter: bool):
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.jitter = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g), jitter

    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = self.x[i] + (torch.randn(4) * 1e-3 if self.jitter else 0.0)
        return x, self.y[i]


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _source(jitter):
    return DatasetSource(Noisy(jitter), label_key="labels")


def test_every_step_records_the_hash_of_what_it_read_and_a_deterministic_trial_matches():
    ref = training.train(_net(), _source(False), CFG, TASK, Policy(), CPU, 0, label="t").records
    assert all(len(r.batch_sha256) == 64 for r in ref) and len({r.batch_sha256 for r in ref}) == len(ref)
    trial = training.train(_net(), _source(False), CFG, TASK, Policy(dtype="bfloat16"), CPU, 0, label="t",
                           expect_batches=[r.batch_sha256 for r in ref]).records
    assert [r.batch_sha256 for r in trial] == [r.batch_sha256 for r in ref]


def test_a_non_deterministic_dataset_is_refused_at_the_first_step_that_differs():
    ref = training.train(_net(), _source(False), CFG, TASK, Policy(), CPU, 0, label="t").records
    with pytest.raises(UserError) as err:
        training.train(_net(), _source(True), CFG, TASK, Policy(dtype="bfloat16"), CPU, 0, label="t",
                       expect_batches=[r.batch_sha256 for r in ref])
    assert "training step 1: the batch read differs from the reference's" in str(err.value)
    assert "not deterministic" in str(err.value) and "\n" not in str(err.value)


class Edited(Noisy):
    """``Noisy`` without jitter, one item shifted: the file behind a training item fixed after a kill."""

    def __init__(self, item: int | None):
        super().__init__(False)
        if item is not None:
            self.x[item] += 3.0


def test_a_resume_rereads_every_recorded_batch_and_restarts_when_an_item_changed(capsys):
    """The item changed is read at step 1 only, before the kill: a state that re-read only its last batch resumed onto
    a run trained half on each version, a result no uninterrupted run gives. Every recorded batch is read again: the
    state is ignored with one line and the run is a clean one on today's data."""
    saved = []
    training.train(_net(), DatasetSource(Edited(None), label_key="labels"), CFG, TASK, Policy(), CPU, 0, label="t",
                   save_resume=saved.append)
    state = saved[0]  # after step 2
    again = training.train(_net(), DatasetSource(Edited(None), label_key="labels"), CFG, TASK, Policy(), CPU, 0, label="t",
                           resume=state)
    assert len(again.records) == CFG.train_steps and capsys.readouterr().err.count("warning") == 0
    order = training.update_batches(64, CFG, 0)
    item = next(int(i) for i in order[0][0] if all(int(i) not in set(b.tolist()) for s in order[1:] for b in s))
    edited = DatasetSource(Edited(item), label_key="labels")
    resumed = training.train(_net(), edited, CFG, TASK, Policy(), CPU, 0, label="t", resume=state)
    err = capsys.readouterr().err
    assert "warning: t: the batch of step 1 reads other bytes than the resume state recorded" in err and "step 0" in err
    clean = training.train(_net(), edited, CFG, TASK, Policy(), CPU, 0, label="t")
    assert [r.loss for r in resumed.records] == [r.loss for r in clean.records]
    assert all(torch.equal(resumed.state.tensors[k], clean.state.tensors[k]) for k in clean.state.tensors)


class _Items(torch.utils.data.Dataset):
    def __init__(self, bad: int, how: str) -> None:
        self.bad, self.how = bad, how

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        x = torch.ones(3)
        if i == self.bad and self.how == "raise":
            raise KeyError("column 'pixels' missing")
        if i == self.bad and self.how == "nan":
            x[0] = float("nan")
        y = {"complex": torch.tensor(1 + 2j), "float": torch.tensor(1.5),
             "nan_target": torch.tensor(float("nan"))}.get(self.how if i == self.bad else "", torch.tensor(1))
        return x, y


@pytest.mark.parametrize(("how", "words"), [
    ("raise", ["raised KeyError on item 5", "column 'pixels' missing", "__getitem__"]),
    ("nan", ["training item 5 holds NaN or inf"]),
    ("complex", ["training item 5", "cannot be complex"]),
    ("float", ["training item 5", "whole numbers, found 1.5"]),
    ("nan_target", ["training item 5 holds NaN or inf", "clean the data"]),
])
def test_a_bad_dataset_item_is_named_in_one_line_with_its_training_step(how, words):
    from pipeline import training
    from pipeline.config import Policy, ReferenceConfig, TaskConfig

    source = task.DatasetSource(_Items(5, how), "labels", "mymod:load", "classification")
    cfg = ReferenceConfig(train_steps=4, batch_size=4, checkpoint_every=0)
    order = training.update_batches(len(source), cfg, 0)
    step = next(s for s, batches in enumerate(order) if 5 in batches[0].tolist()) + 1
    with pytest.raises(UserError) as err:
        training.train(torch.nn.Linear(3, 3), source, cfg, TaskConfig(), Policy(), torch.device("cpu"), 0)
    line = str(err.value)
    assert (
        "\n" not in line and line.startswith(f"training step {step}: task.data mymod:load: ")
        and all(w in line for w in words)
    ), line
