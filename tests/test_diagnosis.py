"""Diagnostics: the stress examples through real `dvc repro`, the precision map, gradient underflow,
missing kernels, the exact replay of a training step, and the cost on a healthy trial."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from _project import ROOT, dvc, merge, run, stage
from conftest import TINY, make_project

from pipeline import precision, recipe

from pipeline import rule
from pipeline.artifacts import comparison, diagnosis
from pipeline.artifacts.comparison import Stats
from pipeline.config import ParamsLoader, load_params
from pipeline.diagnosis import precision_map, replay, search, trace, wording
from pipeline.errors import UserError
from pipeline.files import dumps
from pipeline.examples import stress
from pipeline.config import Policy

CPU = torch.device("cpu")


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y)


def example(name: str) -> dict:
    """An example params file with the tiny sizes of the test suite (its task, rule and diagnose kept)."""
    params = yaml.safe_load((ROOT / "examples" / f"{name}.params.yaml").read_text())
    return merge(params, {k: v for k, v in TINY.items() if k != "acceptance"})


@pytest.mark.integration
def test_overflow_example_rolls_fp16_back_naming_the_culprit_and_accepts_bf16(tmp_path):
    repo = make_project(tmp_path / "repo", example("stress_overflow"))
    dvc(repo, "repro", "decide")

    fp16 = json.loads((repo / "data/decision/float16/decision.json").read_text())
    assert fp16["decision"] == "rollback"
    # the diagnosis', beside the reasons
    culprit_findings = [f for f in fp16["findings"] if "module 'amplify' (Linear, aten.addmm" in f]
    assert culprit_findings and "float16's largest finite value is 65504" in culprit_findings[0]
    assert any("suggested fp32_modules: ['amplify']" in f for f in fp16["findings"])

    diag = json.loads((repo / "data/diagnose/float16/diagnosis.json").read_text())
    assert diag["needed"] and diag["reference_fails_rule"] == []
    first = diag["first_nonfinite"]
    assert {loc["case"].split(" ")[0] for loc in first} == {"inference", "training"}
    for loc in first:
        assert loc["amp"]["first"]["where"] == "module" and loc["amp"]["first"]["module"] == "amplify"
        assert loc["amp"]["first"]["output_dtypes"] == "float16"
        assert loc["fp32"]["first"] is None and loc["fp32"]["outputs_finite"]  # the reference is finite on the same case
        assert loc["fp32"]["modules"]["amplify"]["max_abs"] > 65504
    assert diag["local_fix"][0]["cases_finite"] and diag["reruns"][-1]["decision"] == "accept"
    assert diag["suggestion"] == {
        "fp32_modules": ["amplify"],
        "rule_passes": True,
        "file": "data/diagnose/float16/suggested_params.yaml",
    }
    snippet = (repo / "data/diagnose/float16/suggested_params.yaml").read_text()
    assert yaml.load(snippet, Loader=ParamsLoader) == {  # as DVC and the stages read params.yaml (YAML 1.2: off is a word)
        "trial": {"policies": {"float16": {"dtype": "float16", "compile": "off", "float8": "off", "fp32_modules": ["amplify"]}}}
    }
    assert """dvc exp run -S 'trial.policies.float16.fp32_modules=["amplify"]'""" in snippet
    assert load_params(repo / "params.yaml").trial.policies["float16"].fp32_modules == ()  # suggested, never applied

    bf16 = json.loads((repo / "data/decision/bfloat16/decision.json").read_text())
    assert bf16["decision"] == "accept", bf16["reasons"]
    healthy = json.loads((repo / "data/diagnose/bfloat16/diagnosis.json").read_text())
    assert not healthy["needed"] and healthy["findings"] == []
    assert healthy["work"] == {"replayed_steps": 0, "traced_passes": 4, "trial_reruns": 0}  # the probe (probe: always), no replay
    assert healthy["precision_map"]["summary"]["reduced_share"] == 1.0

    # Publish's last line offers the suggested experiment as the next step, before the restore (issue 51, friction 6),
    # and that step, run as printed, turns the rollback into an accept.
    said = run([sys.executable, "-c", "from pipeline.artifacts import variant; from pipeline.present import verdict; "
                "print(verdict.one_line([verdict.of(variant.load('float16'))]))"], repo).stdout.strip()
    printed = said.split("; next: ", 1)[1].rsplit(")", 1)[0]
    assert printed == ("""dvc exp run -S 'trial.policies.float16.fp32_modules=["amplify"]' -S 'trial.variants=[float16]'"""), said
    run(["bash", "-c", printed], repo, timeout=900)
    assert json.loads((repo / "data/decision/float16/decision.json").read_text())["decision"] == "accept"


@pytest.mark.integration
def test_no_fp32_region_is_suggested_that_leaves_too_little_in_reduced_precision(tmp_path, monkeypatch):
    """The overflow example widened (hidden 256, 4 features, 2 classes) so that 'amplify', the matmul that overflows
    in float16, holds 98 % of the matmul FLOPs: putting it in FP32 makes the replayed cases finite, and leaves 1.8 %
    in float16, below acceptance.min_amp_share (0.1). Neither the non-finite fix nor the tolerance search suggests it
    or spends a re-run on it; each says in one line that no region keeping 10 % passes."""
    widened = merge(example("stress_overflow"), {"task": {"options": {"features": 4, "hidden": 256, "classes": 2}},
                                                  "trial": {"variants": ["float16"]}})
    repo = make_project(tmp_path / "repo", widened)
    dvc(repo, "repro", "decide@float16")

    diag = json.loads((repo / "data/diagnose/float16/diagnosis.json").read_text())
    assert diag["local_fix"][0]["to"] == ["amplify"] and diag["local_fix"][0]["cases_finite"]  # what a fix would be
    assert diag["suggestion"] is None and diag["reruns"] == []  # not suggested, no re-run spent on it
    assert not (repo / "data/diagnose/float16/suggested_params.yaml").exists()
    said = [f for f in diag["findings"] if f.startswith("no FP32 region")]
    assert len(said) == 1 and said[0].startswith(
        "no FP32 region that keeps at least 10 % of the FLOPs in float16 passes the rule: the non-finite values need "
        "'amplify' outside autocast, which leaves 1.8 % of the matmul, convolution and attention FLOPs in float16"), said
    assert not any("suggested fp32_modules" in f for f in diag["findings"])
    fp16 = json.loads((repo / "data/decision/float16/decision.json").read_text())
    assert fp16["decision"] == "rollback" and said[0] in fp16["findings"]
    assert "amp: autocast (float16) engaged on 100.0 % of the matmul/convolution/attention FLOPs (minimum 10 %)" in fp16["checks"]

    # The tolerance search on the same trial: the ranked prefixes are audited before any re-run.
    monkeypatch.chdir(repo)
    params = load_params("params.yaml")
    stats = comparison.read("float16")  # read_json: its non-finite figures back to floats
    ctx, run, _ = replay.load(params, "float16", stats, rule.decide(stats, params.acceptance))
    out = search.Outcome()
    assert search.search_tolerance(ctx, run.policy, out) is None and out.short_of_share and out.reruns == []
    assert out.ranking[0].module == "amplify" and ctx.work.trial_reruns == 0
    assert out.findings == [
        "no FP32 region that keeps at least 10 % of the FLOPs in float16 passes the rule: 'amplify', the top-ranked "
        "module, in FP32 alone, which leaves 1.8 % of the matmul, convolution and attention FLOPs in float16; keep the "
        "FP32 reference (acceptance.min_amp_share)"
    ]


def test_underflow_example_gradients_vanish_without_scaling_and_survive_with_it():
    options = yaml.safe_load((ROOT / "examples/stress_underflow.params.yaml").read_text())["task"]["options"]
    data = stress.load_underflow_data(**options)
    torch.manual_seed(0)
    model = stress.build_underflow_model(**options)
    x, y = data["train_x"][:64], data["train_y"][:64]
    loss = recipe.loss_function("mse")

    fp16 = precision_map.gradient_underflow(model, x, y, loss, Policy(dtype="float16"), CPU, scale=65536.0)
    rows = {r.parameter: r for r in fp16.parameters}
    for name in ("body.weight", "body.bias"):
        assert rows[name].nonzero_fp32 == rows[name].elements
        assert rows[name].fraction_unscaled == 1.0  # every element vanished in float16
        assert rows[name].fraction_scaled < 0.01  # and survives at the GradScaler's initial scale
    assert rows["head.weight"].fraction_unscaled == 0.0
    assert fp16.total.elements == sum(r.elements for r in fp16.parameters)
    assert fp16.total.fraction_unscaled == fp16.total.vanished_unscaled / fp16.total.elements

    bf16 = precision_map.gradient_underflow(model, x, y, loss, Policy(dtype="bfloat16"), CPU, scale=65536.0)
    assert bf16.total.vanished_unscaled == 0  # BF16 has FP32's exponent range

    pmap = precision_map.precision_map(model, x, y, loss, Policy(dtype="float16"), CPU)
    findings, notes = wording.probe_findings(pmap, fp16, Policy(dtype="float16"), CPU)
    assert findings == []
    assert any("without loss scaling" in n and "body.weight 100%" in n and "GradScaler's scale 65536" in n for n in notes), notes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_precision_map_lists_reduced_matmuls_and_respects_fp32_regions(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])

    pmap = precision_map.precision_map(model, x, y, cross_entropy, Policy(dtype=dtype), CPU)
    ops = {(r.phase, r.op, r.input_dtypes): r for r in pmap.ops}
    assert ops[("forward", "aten.addmm.default", f"{dtype},{dtype},{dtype}")].count == 2
    assert ops[("backward", "aten.mm.default", f"{dtype},{dtype}")].count == 3  # 2 weight grads, 1 input grad
    assert pmap.summary.share_weighted_by == "flops" and pmap.summary.reduced_share == 1.0
    assert pmap.missing_kernels == () and pmap.error is None

    mixed = precision_map.precision_map(model, x, y, cross_entropy, Policy(dtype=dtype, fp32_modules=("0",)), CPU)
    assert ("forward", "aten.addmm.default", "float32,float32,float32") in {(r.phase, r.op, r.input_dtypes) for r in mixed.ops}
    flops = mixed.matmul_by_module
    assert flops["0"].reduced_flops == 0 and flops["2"].reduced_flops == flops["2"].flops > 0
    assert 0 < mixed.summary.reduced_share < 1


class Bessel(torch.nn.Module):
    """Bessel features, as in some physics-informed models: aten.special_bessel_j0 has no reduced-precision CPU kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.bessel_j0(x)


@pytest.mark.parametrize(
    ("dtype", "activation", "op"),
    [("float16", torch.nn.RReLU(), "aten.rrelu_with_noise.default"), ("bfloat16", Bessel(), "aten.special_bessel_j0.default")],
)
def test_op_without_reduced_precision_kernel_is_a_finding_not_a_crash(dtype, activation, op):
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(8, 16))
    model.add_module("act", activation)
    model.add_module("head", torch.nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    # torch 2.4 raises RuntimeError("... not implemented for 'Half'"), newer torch NotImplementedError: both a missing kernel
    with pytest.raises((NotImplementedError, RuntimeError), match="not implemented for"), torch.autocast(
            "cpu", dtype=getattr(torch, dtype)):
        model(x)  # the real thing: the trial itself would stop here

    pmap = precision_map.precision_map(model, x, y, cross_entropy, Policy(dtype=dtype), CPU)
    assert pmap.error is None  # the op ran in float32 and the pass went on, backward included
    assert [(m.op, m.module, m.module_type, m.dtypes) for m in pmap.missing_kernels] == [
        (op, "act", type(activation).__name__, (dtype,))
    ]
    assert "not implemented for" in pmap.missing_kernels[0].error
    assert any(r.phase == "backward" and r.op == "aten.mm.default" for r in pmap.ops)
    under = precision_map.gradient_underflow(model, x, y, cross_entropy, Policy(dtype=dtype), CPU, 65536.0, fallback=True)
    findings, _ = wording.probe_findings(pmap, under, Policy(dtype=dtype), CPU)
    assert any(f.startswith(f"op {op} has no {dtype} kernel on cpu (module 'act'") for f in findings), findings


def test_every_pass_of_the_diagnosis_starts_in_strict_fp32():
    """TF32 on (cuDNN's default on Ampere and newer) must not make the FP32 side of a comparison TF32: the
    precision map and the gradient-underflow probe switch it off before their first op (issue 12 item 6)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    saved = precision.tf32_state()
    precision.set_tf32(False)
    strict = precision.tf32_state()
    try:
        for probe in (
            lambda: precision_map.precision_map(model, x, y, cross_entropy, Policy(dtype="bfloat16"), CPU),
            lambda: precision_map.gradient_underflow(model, x, y, cross_entropy, Policy(dtype="bfloat16"), CPU, 65536.0),
            lambda: trace.trace(model, x, y, cross_entropy, Policy(), CPU),
        ):
            precision.set_tf32(True)
            assert precision.tf32_state() != strict
            probe()
            assert precision.tf32_state() == strict
    finally:
        precision.set_tf32_state(saved)


@pytest.mark.gpu
def test_fp32_side_of_a_gpu_trace_is_not_tf32():
    """On a GPU with TF32 switched on beforehand, the FP32 trace's matmuls are exact FP32: their outputs match
    a float64 computation to FP32's precision (TF32's 10-bit mantissa would be off by ~1e-3)."""
    gpu = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False)).to(gpu)
    x = torch.randn(256, 512, device=gpu)
    saved = precision.tf32_state()
    try:
        precision.set_tf32(True)
        traced = trace.trace(model, x, None, None, Policy(), gpu)
        with torch.no_grad():
            out = model(x)  # right after the trace: the switch it set is still in force
            exact = (x.double() @ model[0].weight.double().T)
        assert traced.outputs_finite
        assert float(((out.double() - exact).abs().max() / exact.abs().max())) < 1e-5
    finally:
        precision.set_tf32_state(saved)


def test_probes_leave_the_rng_where_they_found_it():
    """Dropout draws the same masks in every pass of a probe, and the caller's RNG stream does not move."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)).train()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    before = torch.get_rng_state()
    precision_map.precision_map(model, x, y, cross_entropy, Policy(dtype="bfloat16"), CPU)
    under = precision_map.gradient_underflow(model, x, y, cross_entropy, Policy(), CPU, 1.0)
    assert torch.equal(torch.get_rng_state(), before)
    assert under.total.vanished_unscaled == 0  # FP32 against FP32 with the same masks: nothing vanishes


def test_training_replay_is_the_exact_step_of_the_trial(reproduced, monkeypatch):
    monkeypatch.chdir(reproduced)  # read only: stages read data/ relative to the repository
    params = load_params("params.yaml")
    stats = Stats.from_dict(json.loads(Path("data/compare/float16/stats.json").read_text()))
    trajectory = json.loads(Path("data/trial/float16/trajectory.json").read_text())
    ctx, run, _ = replay.load(params, "float16", stats, rule.decide(stats, params.acceptance))
    case = replay.training_case(ctx, run, step=5)
    assert case.replay_matches_trial and ctx.work.replayed_steps == 5
    watched = case.trace(ctx, run.policy)
    assert watched.loss == trajectory["steps"][5]["loss"]  # bit for bit, hooks and dispatch mode included
    assert watched.scale == trajectory["steps"][5]["scale"]
    assert trace.finite(watched) and watched.first is None


@pytest.mark.integration
def test_diagnose_is_cheap_on_a_healthy_trial(reproduced, tmp_path):
    decision = json.loads((reproduced / "data/decision/float16/decision.json").read_text())
    assert decision["decision"] == "accept", "the tiny default float16 trial is expected healthy"
    diag = json.loads((reproduced / "data/diagnose/float16/diagnosis.json").read_text())
    assert not diag["needed"] and diag["findings"] == []
    assert diag["work"] == {"replayed_steps": 0, "traced_passes": 0, "trial_reruns": 0}  # diagnose.probe: on_failure

    copy = tmp_path / "copy"
    shutil.copytree(reproduced, copy, symlinks=True)
    seconds = {}
    for name in ("diagnose", "trial"):
        start = time.perf_counter()
        assert stage(copy, name, "--variant", "float16").returncode == 0
        seconds[name] = time.perf_counter() - start
    print(f"healthy float16: diagnose {seconds['diagnose']:.1f}s, trial {seconds['trial']:.1f}s (whole processes)")
    assert seconds["diagnose"] < seconds["trial"] / 2  # a JSON read and no torch, against a whole (tiny) training
    assert (copy / "data/diagnose/float16/diagnosis.json").read_bytes() == (
        reproduced / "data/diagnose/float16/diagnosis.json"
    ).read_bytes()


def test_diagnosis_records_read_back_key_for_key():
    """A diagnosis built from real passes (a non-finite trace, a precision map, an underflow table) and the
    search's records reads back from its JSON to the same records, ``from`` and ``to`` keys and omitted fields
    included (the file's bytes again); a key this version does not know is refused with the command that rebuilds the file."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(4, 8) * 1e4, torch.tensor([0, 1, 2, 0])
    amp = trace.trace(model, x, y, cross_entropy, Policy(dtype="float16"), CPU, scale=65536.0)
    assert not trace.finite(amp) and amp.first is not None and amp.first.where != "input"
    blind = trace.trace(model, x.clone().fill_(math.inf), y, cross_entropy, Policy(dtype="float16"), CPU)
    assert blind.first == diagnosis.FirstNonFinite("input") and blind.first.as_dict() == {"where": "input"}
    step = diagnosis.FixStep(("0",), (False,), (amp.first,))
    found = diagnosis.Diagnosis(
        needed=True,
        failing=["values"],
        findings=["a finding"],
        work=diagnosis.Work().plus(traced_passes=2),
        precision_map=precision_map.precision_map(model, x, y, cross_entropy, Policy(dtype="float16"), CPU),
        underflow=precision_map.gradient_underflow(model, x, y, cross_entropy, Policy(dtype="float16"), CPU, 65536.0),
        first_nonfinite=(diagnosis.LocatedCase("training step 0", (), 0, 65536.0, True, amp, blind, None),),
        local_fix=(diagnosis.LocalFix((), ("0",), False, (step,)),),
        reruns=(),
        ranking=(),
    )
    raw = json.loads(dumps(found.as_dict()))
    assert raw["local_fix"][0]["from"] == [] and raw["local_fix"][0]["to"] == ["0"]
    assert raw["suggestion"] is None and "unflipped_by" not in raw  # the search ran and chose nothing; no flips
    assert raw["work"] == {"replayed_steps": 0, "traced_passes": 2, "trial_reruns": 0}
    back = diagnosis.from_dict(raw)
    assert dumps(back.as_dict()) == dumps(found.as_dict())  # byte for byte (the blind trace's NaN loss is no == match)
    assert back.first_nonfinite[0].amp == amp and back.local_fix == found.local_fix and back.underflow == found.underflow
    with pytest.raises(UserError, match=r"rebuild it with `dvc repro --force diagnose@float16`"):
        diagnosis.from_dict({**raw, "work": {**raw["work"], "seconds": 1.0}}, variant="float16")


def test_diagnose_params_are_validated(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("diagnose: {search_budget: -1}\n")
    with pytest.raises(UserError, match=r"diagnose\.search_budget is -1"):
        load_params(path)
    path.write_text("diagnose: {probe: sometimes}\n")
    with pytest.raises(UserError, match=r"diagnose\.probe"):
        load_params(path)
    assert math.isfinite(load_params(ROOT / "examples/stress_overflow.params.yaml").task.options["gain"])


def test_max_abs_is_the_largest_finite_magnitude_whatever_else_the_tensor_holds() -> None:
    t = torch.tensor([1.5, -3.0, 2.0])
    assert precision_map.max_abs(t) == 3.0
    assert precision_map.max_abs(torch.tensor([1.5, float("inf"), -3.0, float("nan")])) == 3.0  # the masked path
    assert precision_map.max_abs(torch.tensor([float("nan"), float("-inf")])) == 0.0
    assert precision_map.max_abs(torch.empty(0)) == 0.0
    assert precision_map.max_abs(torch.tensor([65504.0, -1.0], dtype=torch.float16)) == 65504.0
