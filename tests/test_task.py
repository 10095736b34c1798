"""The task contract: inputs and outputs as users have them, their targets and data functions, and the cases (unit tests, CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline import cases, config, heads, recipe, task
from pipeline.config import PrepareConfig, TaskConfig
from pipeline.errors import UserError

# --- inputs -------------------------------------------------------------------------------------------------


def test_dict_inputs_keep_dtypes_and_index_like_a_tensor():
    x = task.check_inputs(
        {"input_ids": torch.arange(12).reshape(4, 3), "mask": torch.ones(4, 3, dtype=torch.bool)}, "eval_x", "m:f"
    )
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


# --- cases --------------------------------------------------------------------------------------------------


def test_cases_for_token_ids_select_boundary_samples_and_keep_user_edges():
    ids = torch.randint(0, 50, (12, 6), generator=torch.Generator().manual_seed(0))
    data = task.TaskData(
        train=task.TensorSource(task.Batch({"input_ids": ids}), torch.zeros(12, dtype=torch.long)),
        eval_x=task.Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
        eval_y=torch.arange(12) % 2,
        eval_ids=[f"s{i}" for i in range(12)],
        edge_x=task.Batch(
            {"input_ids": torch.zeros(1, 6, dtype=torch.long), "attention_mask": torch.zeros(1, 6, dtype=torch.long)}
        ),
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


def test_per_token_boundary_cases_are_scored_a_slice_of_rows_at_a_time(monkeypatch):
    """An LM's fixed set scores [N, T, V]: the nearest-to-the-boundary sequences are chosen from slices of rows,
    never the whole scores at once, and the choice is the one the whole scores give."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(40, 6, 50, generator=gen)
    ordinary = cases.Cases(ids=[f"ordinary/s{i}" for i in range(40)], x=torch.arange(40 * 6).reshape(40, 6),
                           y=torch.zeros(40, 6, dtype=torch.long), has_target=torch.ones(40, dtype=torch.bool))
    asked = []

    def score(x):
        asked.append(x.shape[0])
        return scores[x[:, 0] // 6]

    whole = cases.margins(scores).argsort()[:3].tolist()
    monkeypatch.setattr(cases, "SCORED_ELEMENTS", 6 * 50 * 7)  # 7 sequences of scores at most
    chosen = cases.boundary_cases(score, ordinary, 3, 1e-3, ordinary.y)
    assert max(asked) == 7 and sum(asked) == 1 + 40  # one sequence to size the slices, then every row once
    assert chosen.ids == [f"selected/s{i}" for i in whole]
    assert chosen.y.shape == (3, 6) and not bool(chosen.has_target.any())


def test_mixed_inputs_scale_only_floating_tensors():
    pixels = torch.rand(6, 3, 4, 4)
    x = task.Batch({"pixel_values": pixels, "ids": torch.arange(6).unsqueeze(1)})
    data = task.TaskData(train=task.TensorSource(x, torch.zeros(6)), eval_x=x, eval_y=torch.zeros(6, dtype=torch.long),
                         eval_ids=[str(i) for i in range(6)])
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
    (tmp_path / "params.yaml").write_text(
        "task: {data: 'smalldata:load_data'}\nprepare: {ordinary_cases: 100, edge_samples: 1}\n"
    )
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


def test_class_targets_that_are_not_whole_numbers_or_complex_are_refused():
    with pytest.raises(UserError, match=r"train_y: class targets must be whole numbers, found 0\.5"):
        task.check_targets(torch.tensor([1.0, 0.5]), "classification", "train_y")
    with pytest.raises(UserError, match="cannot be complex"):
        task.check_targets(torch.tensor([1 + 0j]), "regression", "train_y")
    task.check_targets(torch.tensor([1.0, 2.0]), "classification", "train_y")  # whole floats are exact classes
    task.check_targets(torch.tensor([0.5]), "regression", "train_y")


def test_model_outputs_give_every_head_and_leave_inner_states_out():
    """Hugging Face models (random init): T5's cache and encoder states are not outputs beside its logits; BERT's
    pre-training heads are both outputs, its hidden states are not; a base model's hidden states are its output."""
    import transformers
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    small = dict(num_attention_heads=2, intermediate_size=32, vocab_size=50)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                                       num_heads=2, vocab_size=50)).eval()
    out = t5(input_ids=ids, decoder_input_ids=ids)
    assert "encoder_last_hidden_state" in out and set(task.named_outputs(out)) == {"logits"}
    bert = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, attn_implementation="eager", **small)
    out = transformers.BertForPreTraining(bert).eval()(input_ids=ids, output_hidden_states=True, output_attentions=True)
    assert set(task.named_outputs(out)) == {"prediction_logits", "seq_relationship_logits"}
    out = transformers.BertModel(bert).eval()(input_ids=ids)
    assert set(task.named_outputs(out)) == {"last_hidden_state", "pooler_output"}
    moe = transformers.modeling_outputs.MoeCausalLMOutputWithPast(logits=torch.zeros(2, 5, 50), aux_loss=torch.tensor(0.1))
    assert set(task.named_outputs(moe)) == {"logits"}  # a scalar of the batch is no output per case
    # RT-DETR's decoder layers' and encoder's proposals are inner states beside its logits and boxes.
    rt = transformers.models.rt_detr.modeling_rt_detr.RTDetrObjectDetectionOutput(
        logits=torch.zeros(2, 10, 3), pred_boxes=torch.zeros(2, 10, 4), intermediate_logits=torch.zeros(2, 2, 10, 3),
        enc_topk_logits=torch.zeros(2, 10, 3), init_reference_points=torch.zeros(2, 10, 4))
    assert set(task.named_outputs(rt)) == {"logits", "pred_boxes"}


def test_the_primary_output_is_named_output_or_logits_else_like_scores_else_not_features():
    assert heads.primary_name(["output", "logits"]) == "output" and heads.primary_name(["aux", "logits"]) == "logits"
    assert heads.primary_name(["start_logits", "end_logits"]) == "end_logits"
    clip = ["image_embeds", "logits_per_image", "logits_per_text", "text_embeds"]  # CLIP: the scores, not an embedding
    assert heads.primary_name(clip) == "logits_per_image"
    assert heads.primary_name(["embedding", "value"]) == "value" and heads.primary_name(["b", "a"]) == "a"
    outputs = {name: torch.zeros(1) for name in clip}
    assert task.primary(outputs) is outputs["logits_per_image"]
    with pytest.raises(UserError, match="field 'boxes' is list, not a tensor"):
        task.named_outputs({"logits": torch.zeros(2, 3), "boxes": [torch.zeros(4)]})
    assert task.named_outputs({"logits": torch.zeros(2, 3), "loss": None}).keys() == {"logits"}


def test_a_model_not_in_float32_is_no_reference(tmp_path, monkeypatch):
    """A model built in bfloat16 (Hugging Face's torch_dtype=torch.bfloat16, .half(), .to(dtype)) runs the same ops with
    autocast or without: its "FP32 reference" is the trial itself, and every trial would be accepted, the verdict saying
    FP32 -> bfloat16 changes nothing. One in float64 is no FP32 reference either (autocast leaves float64 alone). Both
    are refused in one line where the model is built; float32 weights with integer buffers pass."""
    import transformers
    config_ = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config_).to(torch.bfloat16).eval()
    ids = torch.randint(0, 50, (4, 8))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(input_ids=ids).logits
    assert torch.equal(plain, amp)  # no trial could differ from such a reference
    (tmp_path / "dtype_models_t.py").write_text(
        "import torch, transformers\n"
        "def gpt2(dtype='float32'):\n"
        "    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)\n"
        "    return transformers.GPT2LMHeadModel(cfg).to(getattr(torch, dtype))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for dtype in ("bfloat16", "float16", "float64"):
        with pytest.raises(UserError, match=rf"returned a model with {dtype} weights; the reference is the model in float32"):
            task.build_model(TaskConfig(model="dtype_models_t:gpt2", options={"dtype": dtype}), seed=0)
    assert isinstance(task.build_model(TaskConfig(model="dtype_models_t:gpt2"), seed=0), torch.nn.Module)


def test_a_tuple_is_named_by_position_and_its_first_is_the_primary():
    """Issue 49: a model returning ``(logits, features)``, as many PyTorch models and Hugging Face's ``return_dict=False``
    do, was refused ("no tensor and no .logits") though the tuple holds two tensors. It is named by position, the first
    the primary; a named tuple by its fields; what is not a per-case tensor (a loss, per-layer states) is left out."""
    from collections import namedtuple

    logits, feats = torch.randn(4, 3), torch.randn(4, 8)
    named = task.named_outputs((logits, feats))
    assert list(named) == ["0", "1"] and named["0"] is logits
    assert heads.primary_name(named) == "0" and heads.primary_by_order(named) == []
    task.check_outputs(named, "regression", 4, torch.randn(4, 3), "m:build")  # no "name no primary" refusal
    task.check_outputs(named, "classification", 4, torch.tensor([0, 1, 2, 0]), "m:build")
    Out = namedtuple("Out", ["scores", "embedding"])
    assert list(task.named_outputs(Out(logits, feats))) == ["embedding", "scores"]
    assert list(task.named_outputs((torch.tensor(0.5), logits, ((feats,), (feats,))))) == ["1"]
    with pytest.raises(UserError, match="returned a tuple with no tensor"):
        task.named_outputs((None, "text"))

    import transformers
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=3))
    ids = torch.randint(0, 32, (2, 5))
    out = task.named_outputs(bert(input_ids=ids, return_dict=False))
    assert list(out) == ["0"] and tuple(out["0"].shape) == (2, 3)


def test_a_labels_floor_refused_under_auto_names_the_metric_that_accepts_it(tmp_path):
    """Friction 9 of issue 51: a multi-label head's floor 0.6 under metric auto (read as -RMSE at load) is refused with a
    fix that every later check accepts: task.metric label_accuracy, whose range holds 0.6."""
    path = tmp_path / "params.yaml"
    path.write_text("task: {kind: regression, loss: model}\nacceptance: {min_quality: 0.6}\n")
    with pytest.raises(UserError, match="for a head decided on labels 0 or 1 .multi-label., task.metric: label_accuracy"):
        config.load_params(path)
    path.write_text("task: {kind: regression, loss: model, metric: label_accuracy}\nacceptance: {min_quality: 0.6}\n")
    params = config.load_params(path)
    assert params.task.metric_name == "label_accuracy"
    from pipeline.config import metric_range
    lo, hi = metric_range(params.task.metric_name)
    assert lo <= params.acceptance.min_quality <= hi  # freeze's range check (refusals._min_quality_in_range) passes too
