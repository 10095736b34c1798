"""The LM case at real scale (scripts/lm_scale.py, examples/sizes/lm-1e9.yaml): the size is valid params of at least
1e9 scores per source, the disk check counts what the stores write, and the LM's data, generated without the dense
transition table, is the one that table gives (the script itself runs for 10-30 minutes: it prints, never asserts)."""

import importlib.util
import math
from pathlib import Path

import torch
import yaml

from pipeline.config import load_params
from pipeline.examples import lm

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("lm_scale", ROOT / "scripts" / "lm_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_size_is_valid_params_of_1e9_scores_per_source(tmp_path):
    script = _script()
    values = script.project_params("lm-1e9", None, None)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    params = load_params(tmp_path / "params.yaml")  # every key known, every value possible
    assert params.compare.store == "compact" and params.reference.fp64_arbiter is None
    cases, scores = script.scores_per_source(values)
    assert cases == 520 and scores >= 1e9
    compact = script.needed_bytes(values)
    assert 8 * scores < compact < 8.8 * scores  # the reference full (4 bytes a score), the trial's two compact (2 each)
    assert script.needed_bytes(dict(values, compare={"store": "full"})) > 1.45 * compact
    assert script.scores_per_source(script.project_params("lm-1e9", 128, None)) == (136, 136 * 64 * 32000)


def _dense_load_data(n, seq_len, vocab, branching, order, seed):
    """The token sequences as the dense [contexts, vocab] table samples them: the specification of lm.load_data."""
    gen = torch.Generator().manual_seed(seed)
    contexts = vocab**order
    logits = torch.full((contexts, vocab), -math.inf)
    succ = torch.randint(1, vocab, (contexts, branching), generator=gen)
    logits.scatter_(1, succ, torch.randn(contexts, branching, generator=gen) * 1.5)
    probs = torch.softmax(logits, dim=1)
    tokens = torch.empty(n, seq_len + 1, dtype=torch.long)
    tokens[:, :order] = torch.randint(1, vocab, (n, order), generator=gen)
    for t in range(order, seq_len + 1):
        context = tokens[:, t - 1] if order == 1 else tokens[:, t - 2] * vocab + tokens[:, t - 1]
        tokens[:, t] = torch.multinomial(probs[context], 1, generator=gen).squeeze(1)
    return tokens


def test_lm_data_without_the_dense_table_is_the_dense_tables():
    for n_train, n_eval, seq_len, vocab, branching, order, seed in [(200, 40, 32, 96, 4, 1, 0), (50, 10, 12, 20, 7, 2, 3)]:
        data = lm.load_data(n_train, n_eval, seq_len, vocab, branching, order, max_padding=0, data_seed=seed)
        tokens = _dense_load_data(n_train + n_eval, seq_len, vocab, branching, order, seed)
        assert torch.equal(torch.cat([data["train_x"], data["eval_x"]]), tokens[:, :-1])
        assert torch.equal(torch.cat([data["train_y"], data["eval_y"]]), tokens[:, 1:])
