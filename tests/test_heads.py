"""Output roles in one home (``pipeline.heads``): every inferred role can be stated instead, and a stated role wins.

Each case is a head whose inferred role is not what the user means; stating the role changes how compare judges it, in
the direction the guide argues (« Une différence faible en valeur absolue peut changer l'action choisie »).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from pipeline import heads, rule
from pipeline.compare import streams
from pipeline.config import AcceptanceConfig, Tolerance
from pipeline.errors import UserError
from _steps import step

FLAT = [step(i) for i in range(12)]
N = 64


def _rule(**outputs) -> AcceptanceConfig:
    return AcceptanceConfig(outputs={"*": Tolerance(atol=0.05, rtol=0.02), **outputs}, max_quality_drop=None,
                            loss_noise_multiple=None)  # (no replicate here: the inference part is what a role changes)


def _compare(kind, cfg, y, ref, trial, loss: str = "cross_entropy"):
    ids = [f"ordinary/c{i}" for i in range(len(y))]
    every = torch.ones(len(y), dtype=torch.bool)
    sources = streams.Sources(ids, y, every, streams.InMemory(ref), streams.InMemory(trial), streams.InMemory(trial))
    runs = streams.Trajectories(FLAT, FLAT, 1.0, scaler_enabled=False)
    from pipeline.config import TaskConfig
    metric = streams.Metric.for_task(TaskConfig(kind=kind, loss=loss, metric="auto"))
    stats, _ = streams.compare_streams(kind, cfg, sources, runs, metric=metric)
    return stats, rule.decide(stats, cfg)


def _classifier():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, 4, generator=g) * 3
    return g, logits, logits.argmax(1)


def test_a_head_stated_labels_is_decided_label_by_label_not_by_argmax() -> None:
    """``tags`` [N, 5] beside the logits is inferred class scores (argmax across 5 classes). A multi-label head's labels
    are independent: one label crossing 0 while the argmax stays is a changed decision, caught only as labels."""
    g, logits, y = _classifier()
    tags = torch.randn(N, 5, generator=g) + torch.tensor([4.0, 0, 0, 0, 0])  # label 0 wins every argmax
    tags[:, 3] = torch.where(tags[:, 3].abs() < 0.5, torch.sign(tags[:, 3]) * 0.5 + tags[:, 3], tags[:, 3])
    trial_tags = tags.clone()
    trial_tags[7, 3] = -tags[7, 3]  # label 3 of case 7 crosses 0; argmax (label 0) unchanged
    ref, trial = {"logits": logits, "tags": tags}, {"logits": logits, "tags": trial_tags}
    loose = Tolerance(atol=10.0, rtol=0.0)  # the values pass: only a decision can fail it
    inferred = _rule(tags=loose)
    assert heads.decided_heads("classification", inferred, {"logits": (N, 4), "tags": (N, 5)}, "logits") == ["logits", "tags"]
    stats, verdict = _compare("classification", inferred, y, ref, trial)
    assert stats.heads["tags"].flips == 0 and verdict.inference == "accept"  # argmax across labels saw nothing
    stated = _rule(tags=Tolerance(atol=10.0, rtol=0.0, role="labels"))
    assert heads.sign_heads("classification", stated, {"logits": (N, 4), "tags": (N, 5)}, "logits") == ["tags"]
    stats, verdict = _compare("classification", stated, y, ref, trial)
    flips = stats.heads["tags"]
    assert flips.flips + flips.near_boundary_flips == 1 and verdict.inference == "rollback"
    assert (flips.flip_list[0].id, flips.flip_list[0].position) == ("ordinary/c7", 3)  # the case and the label, named
    healthy, _ = _compare("classification", stated, y, ref, {"logits": logits, "tags": tags + 0.01})
    assert healthy.heads["tags"].flips == 0


def test_a_head_stated_values_is_not_decided_and_one_stated_classes_is() -> None:
    g, logits, y = _classifier()
    aux = torch.randn(N, 3, generator=g) * 2
    shapes = {"logits": (N, 4), "aux_logits": (N, 3), "embedding": (N, 8)}
    plain = _rule()
    assert heads.decided_heads("classification", plain, shapes, "logits") == ["aux_logits", "logits"]
    values = _rule(aux_logits=Tolerance(role="values"))
    assert heads.decided_heads("classification", values, shapes, "logits") == ["logits"]
    classes = _rule(embedding=Tolerance(role="classes"))
    assert "embedding" in heads.decided_heads("classification", classes, shapes, "logits")  # a feature name, stated
    # Stated values, a changed argmax of aux_logits within its tolerance is no flip; inferred, it is.
    trial_aux = aux.clone()
    top2 = aux.topk(2, dim=1)
    i = int((top2.values[:, 0] - top2.values[:, 1]).argmin())
    trial_aux[i, top2.indices[i, 1]] = top2.values[i, 0] + 1e-3
    wide = Tolerance(atol=1.0, rtol=0.0)
    stats, _ = _compare("classification", _rule(aux_logits=wide), y, {"logits": logits, "aux_logits": aux},
                        {"logits": logits, "aux_logits": trial_aux})
    assert stats.heads["aux_logits"].flips + stats.heads["aux_logits"].near_boundary_flips == 1
    stats, verdict = _compare("classification", _rule(aux_logits=Tolerance(atol=1.0, rtol=0.0, role="values")), y,
                              {"logits": logits, "aux_logits": aux}, {"logits": logits, "aux_logits": trial_aux})
    assert "aux_logits" not in stats.heads and verdict.inference == "accept"


def test_an_output_stated_ignored_is_never_read_and_one_not_stated_is_judged() -> None:
    g, logits, y = _classifier()
    noise = torch.randn(N, 2, generator=g)
    ref, trial = {"logits": logits, "noise": noise}, {"logits": logits, "noise": noise * 5}
    stats, verdict = _compare("classification", _rule(noise=Tolerance(decisions=False)), y, ref, trial)
    assert verdict.inference == "rollback" and stats.values["noise"].failing > 0
    stats, verdict = _compare("classification", _rule(noise=Tolerance(role="ignored")), y, ref, trial)
    assert verdict.inference == "accept" and "noise" not in stats.values


def test_a_regression_primary_stated_labels_is_decided_at_its_threshold() -> None:
    """A plain tensor [N, 3] of 0/1 labels under a user's loss: inferred values (nothing says labels); stated labels at
    0, a value crossing 0 is a flip."""
    g = torch.Generator().manual_seed(1)
    out = torch.randn(N, 3, generator=g) * 4
    y = (out > 0).float()
    trial = out.clone()
    i = int(out.abs().reshape(-1).argmin())
    trial.view(-1)[i] = -out.view(-1)[i]
    stats, verdict = _compare("regression", _rule(output=Tolerance(atol=10.0, rtol=0.0)), y, {"output": out},
                              {"output": trial}, loss="pkg.mod:bce")
    assert stats.flips.flips == 0 and verdict.inference == "accept"  # values only: nothing decided it
    labels = _rule(output=Tolerance(atol=10.0, rtol=0.0, role="labels", threshold=0.0))
    stats, verdict = _compare("regression", labels, y, {"output": out}, {"output": trial}, loss="pkg.mod:bce")
    assert stats.flips.flips + stats.flips.near_boundary_flips == 1 and verdict.inference == "rollback"


def test_a_multi_label_plain_tensor_under_the_models_own_loss_is_inferred_labels_at_zero() -> None:
    """Hugging Face's multi-label head computes BCE on logits itself (``loss: model``, several values per case on 0/1
    targets): decided at 0 even as a plain ``output``; the role table says so."""
    cfg = _rule()
    assert heads.decision_threshold(cfg, "regression", "output", True, False, width=3, loss="model") == 0.0
    assert heads.decision_threshold(cfg, "regression", "output", True, False, width=3, loss="mse") is None  # MSE: values
    assert heads.decision_threshold(cfg, "regression", "output", True, False, width=3, loss="pkg.mod:bce") is None
    assert heads.decision_threshold(cfg, "regression", "output", False, False, width=3, loss="model") is None  # no labels
    values = _rule(output=Tolerance(role="values"))
    assert heads.decision_threshold(values, "regression", "output", True, False, width=3, loss="model") is None


def test_positions_can_be_stated_for_a_primary_whose_name_says_nothing() -> None:
    shapes = {"answer": (N, 12), "other": (N, 12)}
    plain = _rule()
    assert heads.position_names("classification", plain, shapes, "answer") == []
    stated = _rule(answer=Tolerance(role="positions"), other=Tolerance(role="positions"))
    assert heads.position_names("classification", stated, shapes, "answer") == ["answer", "other"]
    qa = {"start_logits": (N, 12), "end_logits": (N, 12)}
    assert heads.position_names("classification", plain, qa, "end_logits") == ["end_logits", "start_logits"]
    said_classes = _rule(start_logits=Tolerance(role="classes"))
    assert heads.position_names("classification", said_classes, qa, "end_logits") == ["end_logits"]


@pytest.mark.parametrize(("kind", "outputs", "shapes", "over", "says"), [
    ("classification", {"logits": Tolerance(role="ignored")}, {"logits": (N, 4)}, [], "is the primary output"),
    ("classification", {"logits": Tolerance(role="labels")}, {"logits": (N, 4)}, [], "decided by argmax"),
    ("regression", {"output": Tolerance(role="classes")}, {"output": (N, 4)}, [], "decided value by value"),
    ("classification", {"flag": Tolerance(role="classes")}, {"logits": (N, 4), "flag": (N,)}, [], "not class scores"),
    ("classification", {"aux": Tolerance(role="positions")}, {"logits": (N, 4), "aux": (N, 4)}, [], "real positions"),
    ("classification", {"tags": Tolerance(role="labels")}, {"logits": (N, 7, 4), "tags": (N, 7, 3)}, [], "one label"),
    ("regression", {"output": Tolerance(role="values")}, {"output": (N, 3)}, [], "drop one"),
])
def test_a_stated_role_the_output_cannot_have_is_refused_in_one_line(kind, outputs, shapes, over, says) -> None:
    cfg = _rule(**outputs)
    if says == "drop one":  # values on a primary the rule's threshold decides
        cfg = dataclasses.replace(cfg, threshold=0.0)
    problem = heads.role_problem(kind, cfg, shapes, heads.primary_name(shapes), over)
    assert problem is not None and says in problem and "\n" not in problem


def test_roles_are_checked_at_load_and_hashed_only_where_said() -> None:
    with pytest.raises(UserError, match="threshold decides role labels only"):
        Tolerance(threshold=0.5).check("acceptance.outputs.x")
    with pytest.raises(UserError, match="drop decisions"):
        Tolerance(decisions=True, role="values").check("acceptance.outputs.x")
    Tolerance(decisions=True, role="labels", threshold=0.5).check("acceptance.outputs.x")
    plain, said = _rule(), _rule(**{"*": Tolerance(atol=0.05, rtol=0.02, role="values")})
    # The default rule's hash before roles existed (d3cccca): a reference frozen then is judged under the same rule.
    assert AcceptanceConfig().sha256() == "1f157f295514929bc6478444a3323c7a0bb5d36f97a424fcfdadeb88205a1c9e"
    assert said.sha256() != plain.sha256()
    assert rule.loosened(_rule(aux=Tolerance(role="classes")), _rule(aux=Tolerance(role="ignored"))) == [
        "outputs.aux.role classes -> ignored"]


def test_the_table_says_inferred_or_stated_and_round_trips() -> None:
    cfg = _rule(tags=Tolerance(role="labels"), noise=Tolerance(role="ignored"))
    shapes = {"logits": (N, 4), "tags": (N, 5), "noise": (N, 2), "embedding": (N, 8), "flag_prob": (N,)}
    roles = heads.resolve("classification", cfg, shapes, "logits", threshold=None, over_positions=[],
                          probabilities={"flag_prob": True}, scales={"logits": 2.5})
    table = {h.name: h for h in roles.heads}
    assert (table["logits"].role, table["logits"].stated, table["logits"].primary) == ("classes", False, True)
    assert (table["tags"].role, table["tags"].stated, table["tags"].decided) == ("labels", True, "each value at 0")
    assert table["noise"].role == "ignored" and table["embedding"].role == "values"
    assert table["flag_prob"].decided == "each value at 0.5"
    assert heads.Roles.from_dict(roles.as_dict()) == roles
    lines = roles.lines()
    assert len(lines) == 1 + len(shapes) and "labels (stated)" in lines[5] and "classes (inferred)" in lines[3]


def test_no_module_but_heads_matches_output_names() -> None:
    """The name patterns live in one module: nothing else compiles a pattern over output names or reads one."""
    root = Path(__file__).resolve().parents[1] / "pipeline"
    patterns = re.compile(r"(FEATURE|DECISION|CLASS|PROBABILITY|LOGIT|POSITION)_NAMES|\bSTATES\.search")
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "heads.py"
                   and patterns.search(p.read_text()))
    assert found == [], f"output-name patterns outside pipeline/heads.py: {found}"


def test_a_plain_multi_label_tensor_no_role_decides_says_in_the_verdict_that_no_decision_was_judged() -> None:
    """A plain tensor [N, 3] of 0/1 labels under a user's own BCE: nothing says its values are logits. Judged by values,
    a label crossing 0 within atol passes, and the verdict says no decision was judged and how to state one."""
    g = torch.Generator().manual_seed(2)
    out = torch.randn(N, 3, generator=g) * 4
    y = (out > 0).float()
    cfg = _rule(output=Tolerance(atol=10.0, rtol=0.0))
    roles = heads.resolve("regression", cfg, {"output": (N, 3)}, "output", threshold=None, over_positions=[],
                          probabilities={}, labels=True)
    assert roles.undecided == ("output",) and roles.heads[0].role == "values"
    ids = [f"ordinary/c{i}" for i in range(N)]
    every = torch.ones(N, dtype=torch.bool)
    sources = streams.Sources(ids, y, every, streams.InMemory({"output": out}), streams.InMemory({"output": -out}),
                              streams.InMemory({"output": out}))
    stats, _ = streams.compare_streams("regression", cfg, sources, streams.Trajectories(FLAT, FLAT, 1.0, scaler_enabled=False),
                                       roles=roles)
    verdict = rule.decide(stats, cfg)
    said = [c for c in verdict.checks if c.startswith("decisions 'output': none judged")]
    assert said and "role: labels" in said[0]
    stated = _rule(output=Tolerance(atol=10.0, rtol=0.0, role="labels"))
    roles = heads.resolve("regression", stated, {"output": (N, 3)}, "output", threshold=0.0, over_positions=[],
                          probabilities={}, labels=True)
    assert roles.undecided == () and roles.heads[0].decided == "each value at 0"
    stats, _ = streams.compare_streams("regression", stated, sources,
                                       streams.Trajectories(FLAT, FLAT, 1.0, scaler_enabled=False), roles=roles)
    assert stats.flips.flips + stats.flips.near_boundary_flips == N and not rule.decide(stats, stated).accepted


BERT = {"model_type": "bert", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32, "max_position_embeddings": 32}


def _table(kind, model, x, y, rule_outputs=None, loss="cross_entropy"):
    """Freeze's role table of a real model's outputs on ``x`` (``vetting.Scan``, as freeze streams them)."""
    import dataclasses

    from pipeline import cases, task, vetting
    from pipeline.config import Params, TaskConfig

    torch.manual_seed(0)
    with torch.no_grad():
        out = task.named_outputs(model.eval()(**x))
    n = len(y)
    fixed = cases.Cases(ids=[f"ordinary/s{i}" for i in range(n)], x=x, y=y, has_target=torch.ones(n, dtype=torch.bool))
    rule = AcceptanceConfig(outputs={"*": Tolerance(atol=1e-3, rtol=0.0), **(rule_outputs or {})})
    params = dataclasses.replace(Params(), task=TaskConfig(kind=kind, loss=loss), acceptance=rule)
    scan = vetting.Scan(params, fixed)
    scan.update(0, out)
    return {h.name: h for h in scan.roles().heads}, scan.roles()


def _tokens(n=12, length=10, vocab=40):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[::3, -3:] = 0  # some padding
    return {"input_ids": ids, "attention_mask": mask}


def test_freeze_tables_the_roles_of_real_hugging_face_heads() -> None:
    """A classifier, an extractive QA head, a multi-label head and a causal LM, tiny configs, random init: the table
    says what each output is, as compare will judge it."""
    hf = pytest.importorskip("transformers")
    x = _tokens()
    torch.manual_seed(0)
    classifier = hf.BertForSequenceClassification(hf.BertConfig(**BERT, num_labels=3))
    table, _ = _table("classification", classifier, x, torch.arange(12) % 3)
    assert (table["logits"].role, table["logits"].decided, table["logits"].stated) == ("classes", "argmax over classes", False)

    qa = hf.BertForQuestionAnswering(hf.BertConfig(**BERT))
    table, roles = _table("classification", qa, x, torch.arange(12) % 7)  # the answer's end, within every real length
    assert {n: h.role for n, h in table.items()} == {"end_logits": "positions", "start_logits": "positions"}
    assert table["end_logits"].primary and table["start_logits"].mask == "real positions"

    multi = hf.BertForSequenceClassification(hf.BertConfig(**BERT, num_labels=4, problem_type="multi_label_classification"))
    labels = (torch.arange(48).reshape(12, 4) % 3 == 0).float()
    table, roles = _table("regression", multi, x, labels, loss="model")
    assert (table["logits"].role, table["logits"].decided) == ("labels", "each value at 0") and roles.undecided == ()

    lm = hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    targets = x["input_ids"].roll(-1, 1).masked_fill(x["attention_mask"] == 0, -100)
    table, _ = _table("classification", lm, x, targets)
    assert (table["logits"].role, table["logits"].shape) == ("classes", (10, 40))
    assert "-100 targets" in table["logits"].mask
    # Stated, a role wins: the QA head's start judged as values only, said so.
    table, roles = _table("classification", qa, x, torch.arange(12) % 7, {"start_logits": Tolerance(role="values")})
    assert (table["start_logits"].role, table["start_logits"].stated) == ("values", True)
    assert "values (stated)" in "\n".join(roles.lines())


def test_a_multi_label_primarys_flip_names_its_case_and_its_label() -> None:
    """Hugging Face's multi-label head (``logits`` [N, L], 0/1 targets): a label crossing 0 rolls back, and the flip
    names the case and the label; a trial within rounding keeps every label and passes."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, 4, generator=g) * 3
    logits = logits + torch.sign(logits) * 0.5  # no label near 0
    y = (logits > 0).float()
    trial = logits.clone()
    trial[11, 2] = -logits[11, 2]
    cfg = _rule(logits=Tolerance(atol=10.0, rtol=0.0))
    stats, verdict = _compare("regression", cfg, y, {"logits": logits}, {"logits": trial}, loss="model")
    assert stats.flips.flips == 1 and verdict.inference == "rollback"
    assert (stats.flips.flip_list[0].id, stats.flips.flip_list[0].position, stats.flips.unit) == ("ordinary/c11", 2, "case")
    stats, verdict = _compare("regression", cfg, y, {"logits": logits}, {"logits": logits + 1e-3}, loss="model")
    assert stats.flips.flips == 0 and verdict.inference == "accept"


def test_a_threshold_stated_twice_for_the_primary_is_refused_unless_they_agree() -> None:
    shapes = {"output": (N, 3)}
    two = dataclasses.replace(_rule(output=Tolerance(role="labels", threshold=0.5)), threshold=0.0)
    assert "keep one of them" in heads.role_problem("regression", two, shapes, "output", [])
    same = dataclasses.replace(_rule(output=Tolerance(role="labels", threshold=0.5)), threshold=0.5)
    assert heads.role_problem("regression", same, shapes, "output", []) is None
