"""Untrusted files and names (issue 24, items 5, 7, 10): a pickled ``pytorch_model.bin`` is never loaded,
ids are escaped before they reach a terminal or MLflow, and a broken Dataset is named, not a traceback."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from pipeline import task
from pipeline.config import TaskConfig
from pipeline.errors import UserError

transformers = pytest.importorskip("transformers")

BERT = {
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
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT))
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


def test_a_pretrained_directory_with_safetensors_loads_and_its_remote_code_never_runs(tmp_path):
    folder = tmp_path / "bert"
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT))
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


# --- item 7: case ids are escaped before a terminal or MLflow sees them -------------------------------------

FORGED = "ordinary/x\npublish: float16 ACCEPT; review: http://evil\x1b[2J"
SCRIPT = "<script>alert(1)</script><img src=x onerror=alert(2)>[click](javascript:alert(3))"


def _verdict(ids: list[str]):
    from pipeline.present import verdict

    flips = [{"id": i, "kind": "ordinary", "boundary": False, "near_boundary": False, "reference_class": 1, "trial_class": 2,
              "reference_margin": 0.5, "trial_margin": 0.1} for i in ids]
    decision = {"decision": "rollback", "reasons": [f"1 flip among real samples: {ids[0]}"], "rule": {}, "env": {}}
    return verdict.verdict("float16", decision, {"flips": {"flip_list": flips}}, {})


def test_an_id_cannot_forge_a_line_or_reach_the_terminal_raw():
    from pipeline.present import verdict

    out = verdict.text(_verdict([FORGED, "y" * 3000]))
    assert "\x1b" not in out and "\npublish:" not in out
    assert "ordinary/x\\npublish: float16 ACCEPT; review: http://evil\\x1b[2J" in out
    assert max(len(line) for line in out.splitlines()) < 400 and "…(+2880 chars)" in out  # a 3,000-character id is capped


def test_html_and_markdown_links_in_an_id_do_not_reach_the_mlflow_description_raw():
    from pipeline.present import verdict

    md = verdict.markdown([_verdict([SCRIPT])]) + verdict.headline([_verdict([SCRIPT])])
    assert "<script" not in md and "<img" not in md and not re.search(r"(?<!\\)\]\(javascript:", md)  # no link
    assert "&lt;script>" in md and "\\[click\\](javascript:alert(3))" in md
    assert "<script" not in verdict.html([_verdict([SCRIPT])])  # report.html escapes, as before


# --- item 10: the user's data function fails: the item and the exception are named ---------------------------


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
        y = {"complex": torch.tensor(1 + 2j), "float": torch.tensor(1.5)}.get(self.how if i == self.bad else "", torch.tensor(1))
        return x, y


@pytest.mark.parametrize(("how", "words"), [
    ("raise", ["raised KeyError on item 5", "column 'pixels' missing", "__getitem__"]),
    ("nan", ["training item 5 holds NaN or inf"]),
    ("complex", ["training item 5", "cannot be complex"]),
    ("float", ["training item 5", "whole numbers, found 1.5"]),
])
def test_a_bad_dataset_item_is_named_in_one_line_with_its_training_step(how, words):
    from pipeline import training
    from pipeline.config import ReferenceConfig, TaskConfig
    from pipeline.config import Policy

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


def test_class_targets_that_are_not_whole_numbers_or_complex_are_refused():
    with pytest.raises(UserError, match=r"train_y: class targets must be whole numbers, found 0\.5"):
        task.check_targets(torch.tensor([1.0, 0.5]), "classification", "train_y")
    with pytest.raises(UserError, match="cannot be complex"):
        task.check_targets(torch.tensor([1 + 0j]), "regression", "train_y")
    task.check_targets(torch.tensor([1.0, 2.0]), "classification", "train_y")  # whole floats are exact classes
    task.check_targets(torch.tensor([0.5]), "regression", "train_y")
