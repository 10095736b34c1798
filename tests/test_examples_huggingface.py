"""The Hugging Face adapter: architectures from a config (random init, nothing downloaded) or a local
directory, through the task contract and one AMP update each (CPU, seconds)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from pipeline import probe, task, training
from pipeline.config import LrSchedule, Policy, ReferenceConfig, TaskConfig
from pipeline.errors import UserError
from pipeline.examples import huggingface as hf

CPU = torch.device("cpu")
BERT = {"model_type": "bert", "vocab_size": 65, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32, "max_position_embeddings": 32}
RESNET = {"model_type": "resnet", "num_channels": 1, "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
          "layer_type": "basic", "num_labels": 10}
RECIPE = ReferenceConfig(train_steps=2, batch_size=4, grad_accumulation=2, optimizer="adamw", lr=1e-3, weight_decay=0.01,
                         checkpoint_every=0, lr_schedule=LrSchedule(kind="cosine", warmup=1))


def build(architecture: str, config: dict) -> torch.nn.Module:
    return task.build_model(
        TaskConfig(model="pipeline.examples.huggingface:build_model", options={"architecture": architecture, "config": config}),
        seed=0,
    )


def source(data: dict) -> task.TensorSource:
    x = task.check_inputs(data["train_x"], "train_x", "hf")
    return task.TensorSource(x[:16], data["train_y"][:16])


@pytest.mark.parametrize(
    "architecture, config, data, loss",
    [
        ("BertForSequenceClassification", {**BERT, "num_labels": 4}, hf.load_token_data(n_train=16, n_eval=4), "model"),
        ("BertForTokenClassification", {**BERT, "num_labels": 5}, hf.load_tagging_data(n_train=16, n_eval=4), "cross_entropy"),
        ("ResNetForImageClassification", RESNET, hf.load_image_data(), "model"),
    ],
)
def test_architectures_run_through_the_contract_and_one_amp_update(architecture, config, data, loss):
    cfg = TaskConfig(
        model="pipeline.examples.huggingface:build_model", loss=loss, options={"architecture": architecture, "config": config}
    )
    model = build(architecture, config)
    again = build(architecture, config)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))  # seeded init
    src = source(data)
    probe.check(model, src, cfg, CPU, eval_mode=True)
    for dtype in ("float16", "bfloat16"):
        result = training.train(build(architecture, config), src, RECIPE, cfg, Policy(dtype=dtype), CPU, seed=0)
        assert len(result.records) == 2 and all(torch.isfinite(torch.tensor(r.loss)) for r in result.records)


def test_from_pretrained_reads_a_local_directory_offline(tmp_path):
    model = build("BertForSequenceClassification", {**BERT, "num_labels": 2})
    model.save_pretrained(tmp_path / "bert")
    loaded = task.build_model(
        TaskConfig(
            model="pipeline.examples.huggingface:build_model",
            options={"architecture": "BertForSequenceClassification", "pretrained": str(tmp_path / "bert")},
        ),
        seed=123,
    )
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_adapter_mistakes_are_one_line():
    with pytest.raises(UserError, match="is not a transformers model class"):
        hf.build_model(architecture="NoSuchModel", config=BERT)
    with pytest.raises(UserError, match="needs model_type"):
        hf.build_model(architecture="BertModel", config={"hidden_size": 8})


transformers = pytest.importorskip("transformers")


PRETRAINED_BERT = {
    "vocab_size": 65, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
    "max_position_embeddings": 32, "num_labels": 2,
}


class _Payload:
    """Unpickling this writes a file: proof that the pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def _pickled_only(tmp_path: Path) -> tuple[Path, Path]:
    """A save_pretrained directory whose weights are only a pickle (``pytorch_model.bin``) with a payload."""
    folder, marker = tmp_path / "bert", tmp_path / "unpickled.txt"
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**PRETRAINED_BERT))
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    with open(folder / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"state": model.state_dict(), "payload": _Payload(marker)}, handle)
    return folder, marker


def _build(folder: Path):
    cfg = TaskConfig(model="pipeline.examples.huggingface:build_model",
                     options={"architecture": "BertForSequenceClassification", "pretrained": str(folder)})
    return task.build_model(cfg, seed=0)


def test_a_pretrained_directory_with_only_a_pickle_is_refused_in_one_line(tmp_path):
    folder, marker = _pickled_only(tmp_path)
    with pytest.raises(UserError) as err:
        _build(folder)
    line = str(err.value)
    assert "\n" not in line and "pytorch_model.bin" in line and "safe_serialization=True" in line, line
    assert not marker.exists()  # nothing was unpickled


def test_a_sharded_index_that_names_a_pickle_or_a_file_outside_is_refused_before_anything_loads(tmp_path):
    """``model.safetensors.index.json`` is a safetensors name, but transformers loads whatever shard its weight_map
    names: a pickled ``.bin`` (with a payload), or a path out of the folder. Refused in one line, nothing unpickled;
    an index of safetensors shards in the folder loads."""
    folder, marker = _pickled_only(tmp_path)
    (folder / "pytorch_model.bin").rename(folder / "shard.bin")
    names = list(transformers.BertForSequenceClassification(transformers.BertConfig(**PRETRAINED_BERT)).state_dict())
    index = folder / "model.safetensors.index.json"
    for shard, said in (("shard.bin", "'shard.bin'"), ("../elsewhere.safetensors", "'../elsewhere.safetensors'")):
        index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, shard)}))
        with pytest.raises(UserError) as err:
            _build(folder)
        line = str(err.value)
        assert "\n" not in line and said in line and "safe_serialization=True" in line, line
        assert not marker.exists()
    index.write_text("[1, 2]")
    with pytest.raises(UserError, match="is not a sharded checkpoint's index"):
        _build(folder)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**PRETRAINED_BERT))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="5KB")  # real shards and their index
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = _build(tmp_path / "sharded")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_a_pretrained_directory_with_safetensors_loads_and_its_remote_code_never_runs(tmp_path):
    folder = tmp_path / "bert"
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**PRETRAINED_BERT))
    model.save_pretrained(folder)
    # A config that asks for remote code: with trust_remote_code=False the named module is never imported.
    (folder / "evil_r24.py").write_text(f"open({str(tmp_path / 'ran.txt')!r}, 'w').write('ran')\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForSequenceClassification": "evil_r24.Evil"}
    (folder / "config.json").write_text(json.dumps(config))
    loaded = _build(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert not (tmp_path / "ran.txt").exists()


def test_a_pretrained_path_that_is_not_a_directory_is_one_line(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        _build(tmp_path / "missing")


GPT2 = {"model_type": "gpt2", "vocab_size": 32, "n_positions": 16, "n_embd": 16, "n_layer": 1, "n_head": 2}


def test_a_causal_lms_own_loss_reads_the_next_token_and_the_fixed_set_is_judged_so():
    """GPT2LMHeadModel given labels = input_ids (Hugging Face's way) shifts them inside its loss: its logits at t are
    trained on the token at t + 1. Scored against the labels as given, the reference would predict none of them (its
    accuracy 0: freeze refuses a healthy model, or, with quality loosened, a trial that changes next tokens passes on
    0 vs 0). The probe measures the shift from the model's own loss, and the fixed set is judged one position ahead;
    a token classifier's own loss (no shift) and a task loss leave the targets as given."""
    from pipeline import cases
    from pipeline.compare.quality import QualityStats

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (16, 12), generator=g)
    ids[3, 8:] = 0
    labels = ids.clone()
    labels[3, 8:] = -100  # padding, as Hugging Face labels it
    x = task.check_inputs({"input_ids": ids}, "train_x", "hf")
    src = task.TensorSource(x, labels)
    gpt2 = build("GPT2LMHeadModel", GPT2)
    own = TaskConfig(model="pipeline.examples.huggingface:build_model", loss="model",
                     options={"architecture": "GPT2LMHeadModel", "config": GPT2})
    assert probe.check(gpt2, src, own, CPU, eval_mode=True) is True
    cross_entropy = TaskConfig(model=own.model, loss="cross_entropy", options=own.options)
    assert probe.check(gpt2, src, cross_entropy, CPU, eval_mode=True) is False
    tags = hf.load_tagging_data(n_train=16, n_eval=4)
    bert = TaskConfig(model=own.model, loss="model",
                      options={"architecture": "BertForTokenClassification", "config": {**BERT, "num_labels": 5}})
    tagger = build("BertForTokenClassification", {**BERT, "num_labels": 5})
    assert probe.check(tagger, source(tags), bert, CPU, eval_mode=True) is False

    fixed = cases.Cases(ids=[f"ordinary/{i}" for i in range(16)], x=x, y=labels,
                        has_target=torch.ones(16, dtype=torch.bool))
    judged = cases.aligned(fixed, True)
    assert torch.equal(judged.y[:, :-1], labels[:, 1:]) and bool((judged.y[:, -1] == -100).all())
    assert judged.meta["targets"].startswith("next token") and cases.aligned(fixed, False) is fixed
    with torch.no_grad():
        logits = gpt2(input_ids=ids).logits
    quality = QualityStats("accuracy", "lowest_index")
    quality.update(logits, judged.y)
    keep = labels[:, 1:] != -100  # Hugging Face's own next-token accuracy
    expected = (logits[:, :-1].argmax(-1) == labels[:, 1:])[keep].double().mean()
    assert quality.result() == pytest.approx(float(expected))


CLIP = {"model_type": "clip", "projection_dim": 8,
        "text_config": {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1},
        "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "image_size": 8, "patch_size": 4}}


def test_in_batch_scores_are_refused_by_the_probe_in_one_line():
    """CLIP's ``logits_per_image`` [B, B] scores each image against the texts of its batch: a case's outputs depend on
    which cases share its batch, and a fixed set past one inference batch wrote [256, 256] then [44, 44] (a traceback
    from the outputs writer). The probe refuses it before any training, naming the output and both shapes."""
    g = torch.Generator().manual_seed(0)
    x = task.Batch({"input_ids": torch.randint(2, 50, (8, 6), generator=g), "pixel_values": torch.randn(8, 3, 8, 8, generator=g)})
    cfg = TaskConfig(model="pipeline.examples.huggingface:build_model", loss="cross_entropy",
                     options={"architecture": "CLIPModel", "config": CLIP})
    with pytest.raises(UserError) as refused:
        probe.check(build("CLIPModel", CLIP), task.TensorSource(x, torch.arange(8) % 2), cfg, CPU, eval_mode=True)
    line = str(refused.value)
    assert "\n" not in line and "'logits_per_image' has shape (2, 2) for a batch of 2 but (1, 1) for a batch of 1" in line
