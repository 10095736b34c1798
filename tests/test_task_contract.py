"""Inputs and outputs as users have them, the user's recipe, and the loss in float32 or wider (unit tests, CPU)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from pipeline import cases, config, recipe, task, training
from pipeline.config import LrSchedule, PrepareConfig, ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.precision import Policy

CPU = torch.device("cpu")


def cfg(**kw):
    return dataclasses.replace(ReferenceConfig(train_steps=8, batch_size=8, lr=0.01, grad_clip=1.0, checkpoint_every=0), **kw)


# --- inputs -------------------------------------------------------------------------------------------------


def test_dict_inputs_keep_dtypes_and_index_like_a_tensor():
    x = task.check_inputs({"input_ids": torch.arange(12).reshape(4, 3), "mask": torch.ones(4, 3, dtype=torch.bool)}, "eval_x", "m:f")
    assert isinstance(x, task.Batch) and x["input_ids"].dtype == torch.int64 and x.shape[0] == 4
    part = x[torch.tensor([3, 1])]
    assert part["input_ids"].tolist() == [[9, 10, 11], [3, 4, 5]] and part["mask"].dtype == torch.bool
    assert task.rows(task.cat([x, part])) == 6
    flat = task.flatten(x)
    assert set(flat) == {"x.input_ids", "x.mask"}
    back = task.unflatten(flat)
    assert all(torch.equal(back[k], x[k]) for k in x)


def test_dict_tensors_disagreeing_on_dim0_is_one_line():
    with pytest.raises(UserError, match=r"disagree on their first dimension \(a: 4, b: 3\)"):
        task.check_inputs({"a": torch.zeros(4, 2), "b": torch.zeros(3, 2)}, "train_x", "m:f")


def test_load_data_takes_targets_from_the_batch_under_label_key(tmp_path, monkeypatch):
    mod = tmp_path / "hfdata.py"
    mod.write_text(
        "import torch\n"
        "def load_data(key='labels', **_):\n"
        "    ids = torch.randint(0, 9, (10, 5), generator=torch.Generator().manual_seed(0))\n"
        "    return {'train_x': {'input_ids': ids, key: ids[:, 0] % 2}, 'eval_x': {'input_ids': ids[:4], key: ids[:4, 0] % 2}}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = task.load_data(TaskConfig(data="hfdata:load_data"))
    assert data.train_x["input_ids"].dtype == torch.int64 and "labels" not in data.train_x
    assert torch.equal(data.eval_y, data.eval_x["input_ids"][:, 0] % 2)
    with pytest.raises(UserError, match=r"has no 'target' \(task.label_key\)"):
        task.load_data(TaskConfig(data="hfdata:load_data", label_key="target"))


def test_outputs_tensor_dict_and_model_output_with_logits():
    logits = torch.randn(2, 3)
    assert task.named_outputs(logits) == {"output": logits}
    assert set(task.named_outputs({"b": logits, "a": logits})) == {"a", "b"}
    hf_like = SimpleNamespace(loss=torch.tensor(1.0), logits=logits, hidden_states=None)
    assert task.named_outputs(hf_like) == {"logits": logits}
    with pytest.raises(UserError, match="no tensor and no .logits"):
        task.named_outputs(SimpleNamespace(loss=torch.tensor(1.0)))


def test_per_token_scores_pass_check_outputs_with_ignored_targets():
    scores = torch.randn(2, 5, 7)
    targets = torch.tensor([[1, 2, -100, -100, -100], [6, 0, 3, 3, -100]])
    task.check_outputs({"logits": scores}, "classification", 2, targets, "m:f")
    with pytest.raises(UserError, match="range over"):
        task.check_outputs({"logits": scores}, "classification", 2, targets + 7 * (targets >= 0), "m:f")
    loss = recipe.cross_entropy(scores, targets)
    keep = targets != -100
    expected = torch.nn.functional.cross_entropy(scores[keep], targets[keep])
    assert torch.allclose(loss, expected)


# --- loss in float32 or wider (issue 12 item 3) -----------------------------------------------------------


class Constant(torch.nn.Module):
    """One weight times an input of 1: under float16 autocast the output is the weight rounded to float16."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.fc.weight.fill_(value)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("target", [300.3, 1.0e5])
def test_targets_are_never_rounded_to_the_autocast_dtype(target):
    """300.3 is 300.25 in float16, so the old loss (target cast to the output's dtype) was exactly 0 for an
    output of 300.25; 1e5 is beyond float16's 65504, so the old loss was inf. Both are wrong."""
    x, y = torch.ones(4, 1), torch.full((4, 1), target)
    out = Constant(300.25)(x).detach().half()
    assert float(torch.tensor(target).half()) != target  # what the old code trained against
    expected = (float(torch.tensor(target)) - 300.25) ** 2  # the float32 target
    loss = recipe.mse(out, y)
    assert loss.dtype == torch.float32
    assert math.isfinite(float(loss)) and float(loss) == pytest.approx(expected, rel=1e-5)
    torch.manual_seed(0)
    regression = TaskConfig(kind="regression", loss="mse")
    result = training.train(Constant(300.25), task.TensorSource(x, y), cfg(train_steps=1, batch_size=4), regression, Policy(dtype="float16"), CPU, seed=0)
    assert result.records[0].loss == pytest.approx(expected, rel=1e-5)


# --- the recipe ---------------------------------------------------------------------------------------------


class Loud(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) * 1000.0


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g) * 0.01, torch.randint(0, 4, (n,), generator=g)


TASK = TaskConfig()  # classification, cross_entropy


def test_accumulation_unscales_once_per_update_and_matches_the_mean_gradient(monkeypatch):
    calls = []
    original = torch.amp.GradScaler.unscale_
    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", lambda self, opt: (calls.append(1), original(self, opt))[1])
    x, y = data()
    c = cfg(train_steps=3, grad_accumulation=2, optimizer="sgd", momentum=0.0, grad_clip=None)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    manual = torch.nn.Linear(8, 4)
    manual.load_state_dict(model.state_dict())
    result = training.train(model, task.TensorSource(x, y), c, TASK, Policy(dtype="float16"), CPU, seed=0)
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


def test_warmup_and_cosine_follow_real_updates_under_forced_skips():
    x, y = data()
    c = cfg(train_steps=16, lr_schedule=LrSchedule(kind="cosine", warmup=3))
    torch.manual_seed(0)
    result = training.train(Loud(), task.TensorSource(x, y), c, TASK, Policy(dtype="float16"), CPU, seed=0)
    assert sum(r.skipped for r in result.records) >= 3
    for r in result.records:
        assert r.lr == pytest.approx(0.01 * recipe.lr_factor(c, r.real_updates))
    assert recipe.lr_factor(c, 0) == 0 and recipe.lr_factor(c, 3) == 1.0 and recipe.lr_factor(c, 16) == pytest.approx(0.0)
    assert recipe.lr_factor(dataclasses.replace(c, lr_schedule=LrSchedule(kind="linear", warmup=0)), 8) == pytest.approx(0.5)


def test_adamw_with_weight_decay_and_betas():
    opt = recipe.make_optimizer(torch.nn.Linear(2, 2), cfg(optimizer="adamw", weight_decay=0.01, betas=[0.8, 0.99]))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.99)


def not_an_optimizer(params):
    return list(params)


def an_optimizer(params):
    return torch.optim.SGD(params, lr=0.5)


def test_optimizer_factory(monkeypatch):
    assert recipe.make_optimizer(torch.nn.Linear(2, 2), cfg(optimizer=f"{__name__}:an_optimizer")).param_groups[0]["lr"] == 0.5
    with pytest.raises(UserError, match="returned list; return a torch.optim.Optimizer"):
        recipe.make_optimizer(torch.nn.Linear(2, 2), cfg(optimizer=f"{__name__}:not_an_optimizer"))


class OwnLoss(torch.nn.Module):
    """Hugging Face style: targets under ``labels``, the loss on the output object."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, labels=None):
        logits = self.fc(x)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits)


def test_loss_model_uses_the_models_own_loss():
    x, y = data()
    torch.manual_seed(0)
    own = training.train(OwnLoss(), task.TensorSource(x, y), cfg(), TaskConfig(loss="model"), Policy(), CPU, seed=0)
    torch.manual_seed(0)
    ours = training.train(OwnLoss(), task.TensorSource(x, y), cfg(), TaskConfig(loss="cross_entropy"), Policy(), CPU, seed=0)
    assert [r.loss for r in own.records] == [r.loss for r in ours.records]
    with pytest.raises(UserError, match="no scalar .loss"):
        recipe.make_loss(TaskConfig(loss="model"))(NoLoss(), x[:2], y[:2])


class NoLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, labels=None):
        return self.fc(x)


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
    x, y = data()
    c = cfg(train_steps=6, grad_accumulation=2)
    torch.manual_seed(0)
    from_tensors = training.train(DictModel(), task.TensorSource(task.Batch({"x": x}), y), c, TASK, Policy(dtype="bfloat16"), CPU, seed=3)
    torch.manual_seed(0)
    source = task.DatasetSource(Items(x, y), "labels")
    from_dataset = training.train(DictModel(), source, c, TASK, Policy(dtype="bfloat16"), CPU, seed=3)
    assert [repr(r) for r in from_dataset.records] == [repr(r) for r in from_tensors.records]
    assert source.fingerprint() == task.DatasetSource(Items(x, y), "labels").fingerprint()
    assert source.fingerprint() != task.DatasetSource(Items(x + 1, y), "labels").fingerprint()


def test_the_noise_replicate_order_swaps_one_sample_per_pair_of_updates():
    order = training.update_batches(64, ReferenceConfig(train_steps=5, batch_size=8, grad_accumulation=1), seed=0)
    swapped = training.neighbours_swapped(order)
    for s in range(5):
        a, b = order[s][0], swapped[s][0]
        assert torch.equal(a[1:], b[1:])  # the rest of every micro-batch as it was
    assert swapped[0][0][0] == order[1][0][0] and swapped[1][0][0] == order[0][0][0]
    assert torch.equal(swapped[4][0], order[4][0])  # an odd last update keeps its batch
    assert sorted(torch.cat([b[0] for b in swapped]).tolist()) == sorted(torch.cat([b[0] for b in order]).tolist())


def test_progress_line_names_step_loss_scale_skipped_and_eta():
    p = training.Progress("trial float16", 10)
    line = p.line(4, 1.25, 32768.0, 2, p.t0 + 2.0)
    assert "step 4/10" in line and "loss 1.2500" in line and "scale 32768" in line and "skipped 2" in line and "ETA 3s" in line


# --- cases --------------------------------------------------------------------------------------------------


def test_cases_for_token_ids_select_boundary_samples_and_keep_user_edges():
    ids = torch.randint(0, 50, (12, 6), generator=torch.Generator().manual_seed(0))
    data = task.TaskData(
        train=task.TensorSource(task.Batch({"input_ids": ids}), torch.zeros(12, dtype=torch.long)),
        eval_x=task.Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
        eval_y=torch.arange(12) % 2,
        eval_ids=[f"s{i}" for i in range(12)],
        edge_x=task.Batch({"input_ids": torch.zeros(1, 6, dtype=torch.long), "attention_mask": torch.zeros(1, 6, dtype=torch.long)}),
        edge_ids=["all-padding"],
    )
    fixed = cases.build(data, PrepareConfig(ordinary_cases=10))
    assert fixed.ids[-1] == "edge/user/all-padding" and fixed.kinds.count("edge") == 1  # nothing scaled: ids are integers
    assert fixed.x["input_ids"].dtype == torch.int64
    ordinary = fixed.select(torch.arange(10))
    scores = torch.tensor([[float(i % 5), 2.0] for i in range(10)])
    boundary = cases.boundary_cases(lambda x: scores[: task.rows(x)], ordinary, 2, 1e-3, fixed.y)
    assert boundary.ids == ["selected/s2", "selected/s7"]  # real samples, their own kind; margin 0 (2 vs 2), earliest first
    with pytest.raises(UserError, match="boundary_method is bisect"):
        cases.boundary_cases(lambda x: scores[: task.rows(x)], ordinary, 2, 1e-3, fixed.y, method="bisect")


def test_mixed_inputs_scale_only_floating_tensors():
    pixels = torch.rand(6, 3, 4, 4)
    x = task.Batch({"pixel_values": pixels, "ids": torch.arange(6).unsqueeze(1)})
    data = task.TaskData(train=task.TensorSource(x, torch.zeros(6)), eval_x=x, eval_y=torch.zeros(6, dtype=torch.long), eval_ids=[str(i) for i in range(6)])
    fixed = cases.build(data, PrepareConfig(ordinary_cases=4, edge_scales=[100.0], edge_samples=1))
    i = fixed.ids.index("edge/scale-100/0")
    assert torch.equal(fixed.x["pixel_values"][i], pixels[0] * 100) and fixed.x["ids"][i].item() == 0
    assert fixed.meta == {"ordinary_requested": 4, "ordinary_available": 6, "ordinary_cases": 4}


# --- params -------------------------------------------------------------------------------------------------


def test_regression_with_a_classification_min_quality_is_refused(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("task: {kind: regression, loss: mse}\nacceptance: {min_quality: 0.9}\n")
    with pytest.raises(UserError, match=r"min_quality 0.9 is outside the range .* of task.metric neg_rmse"):
        config.load_params(path)
    path.write_text("task: {kind: regression, loss: mse}\nacceptance: {min_quality: -1.0}\n")
    assert config.load_params(path).task.metric_name == "neg_rmse"
    path.write_text("task: {kind: classification, metric: top_k, top_k: 3}\nacceptance: {min_quality: 1.5}\n")
    with pytest.raises(UserError, match="outside the range"):
        config.load_params(path)
    path.write_text("task: {metric: 'mypkg.m:score'}\n")
    with pytest.raises(UserError, match="metric_direction: higher or lower"):
        config.load_params(path)


def test_prepare_says_in_one_line_when_ordinary_cases_is_cut_and_records_it(tmp_path, monkeypatch, capsys):
    from pipeline.stages import prepare

    (tmp_path / "smalldata.py").write_text(
        "import torch\n"
        "def load_data(**_):\n"
        "    x = torch.arange(60.0).reshape(30, 2); y = torch.arange(30) % 2\n"
        "    return {'train_x': x[:21], 'train_y': y[:21], 'eval_x': x[21:], 'eval_y': y[21:]}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("task: {data: 'smalldata:load_data'}\nprepare: {ordinary_cases: 100, edge_samples: 1}\n")
    prepare.main()
    out = capsys.readouterr().out
    assert "prepare: prepare.ordinary_cases is 100 but task.data gives 9 eval samples: the fixed set takes all 9" in out
    fixed = cases.load("data/prepared/cases.safetensors")
    assert fixed.meta == {"ordinary_requested": 100, "ordinary_available": 9, "ordinary_cases": 9}
    assert fixed.kinds.count("ordinary") == 9


def test_missing_inputs_and_non_finite_targets_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "gaps.py").write_text(
        "import torch\n"
        "def no_eval(**_):\n"
        "    return {'train_x': torch.zeros(4, 2), 'train_y': torch.zeros(4)}\n"
        "def nan_target(**_):\n"
        "    y = torch.zeros(4); y[1] = float('nan')\n"
        "    return {'train_x': torch.zeros(4, 2), 'train_y': y, 'eval_x': torch.zeros(2, 2), 'eval_y': torch.zeros(2)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="returned no 'eval_x'"):
        task.load_data(TaskConfig(data="gaps:no_eval"))
    with pytest.raises(UserError, match="train_y holds NaN or inf"):
        task.load_data(TaskConfig(kind="regression", loss="mse", data="gaps:nan_target"))


def test_a_micro_batch_whose_targets_are_all_ignored_adds_zero_not_nan():
    scores = torch.randn(2, 3, 5, requires_grad=True)
    loss = recipe.cross_entropy(scores, torch.full((2, 3), -100))
    loss.backward()
    assert float(loss) == 0.0 and bool((scores.grad == 0).all())
    some = torch.tensor([[1, -100, 2], [-100, -100, 4]])
    assert torch.equal(recipe.cross_entropy(scores, some), torch.nn.functional.cross_entropy(scores.reshape(-1, 5), some.reshape(-1)))


def test_a_custom_loss_sees_float32_not_the_autocast_dtype():
    training_loss = recipe.loss_function(f"{__name__}:_record_dtype")
    _RECORD[:] = []
    training_loss(torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 3))
    assert _RECORD == [torch.float32]


_RECORD: list = []


def _record_dtype(out, y):
    _RECORD.append(out.dtype)
    return (out - y).pow(2).mean()
