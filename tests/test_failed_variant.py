"""A variant whose policy makes the model raise gets a verdict (issue 48): the op, the module, the case or the step.

Real autocast on the CPU: ``masked_fill(mask, -1e9)`` under float16 ("value cannot be converted to type c10::Half
without overflow") and ``nn.LSTM`` under float16 (oneDNN has no float16 LSTM on the CPU).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from pipeline import devices, paths
from pipeline.artifacts import trial, trial_tensors
from pipeline.config import Params, Policy, ReferenceConfig
from pipeline.diagnosis import failure
from pipeline.errors import UserError
from pipeline.task import TensorSource

CPU = torch.device("cpu")
FP16, BF16 = Policy(dtype="float16"), Policy(dtype="bfloat16")


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(4, 4)

    def forward(self, x):
        scores = self.q(x) @ x.T
        mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
        return scores.masked_fill(mask, -1e9).softmax(-1) @ x


class Encoder(torch.nn.Module):
    """Masks its attention scores with -1e9: fine in FP32 and bfloat16, an overflow under float16 autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.ModuleDict({"attention": Attention()})
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.encoder["attention"](x))


class Recurrent(torch.nn.Module):
    """An nn.LSTM classifier: no float16 LSTM kernel on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class Loud(torch.nn.Module):
    """Masks with -1e9 only for a row whose first input is above 50: the batch raises, and one case alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        if (x[:, 0] > 50).any():
            h = h.masked_fill(x[:, :1] > 50, -1e9)
        return h


class TrainsBadly(torch.nn.Module):
    """Raises under float16 from its third training forward on (its count is a buffer-free attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            self.calls += 1
            if self.calls >= 3:
                h = h.masked_fill(h > 1e9, -1e9)
        return h


def forward(model, x, policy):
    with torch.autocast("cpu", dtype=getattr(torch, policy.dtype)):
        return model(x)


def test_masked_fill_under_float16_names_the_op_and_the_module():
    torch.manual_seed(0)
    model, x = Encoder(), torch.randn(3, 4)
    raised = failure.watched(model, lambda: forward(model, x, FP16))
    half = "at::Half" if "at::Half" in raised.error else "c10::Half"  # torch 2.4's words, then newer torch's
    assert raised == failure.Raised(
        op="torch.Tensor.masked_fill", module="encoder.attention", module_type="Attention",
        error=f"RuntimeError: value cannot be converted to type {half} without overflow", missing_kernel=False,
    )
    assert failure.watched(model, lambda: forward(model, x, BF16)) is None  # bfloat16's range holds -1e9


def test_lstm_under_float16_on_the_cpu_is_a_missing_kernel():
    torch.manual_seed(0)
    model, x = Recurrent(), torch.randn(2, 5, 4)
    raised = failure.watched(model, lambda: forward(model, x, FP16))
    assert (raised.op, raised.module, raised.module_type, raised.missing_kernel) == ("torch.lstm", "lstm", "LSTM", True)
    assert "primitive descriptor" in raised.error
    assert failure.watched(model, lambda: forward(model, x, BF16)) is None


def test_the_models_own_code_raising_names_its_module_and_no_op():
    class Strict(torch.nn.Module):
        def forward(self, x):
            if x.dtype != torch.float32:
                raise ValueError(f"expected float32, got {x.dtype}")
            return x

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.strict = torch.nn.Linear(4, 4), Strict()

        def forward(self, x):
            return self.strict(self.fc(x))

    model = Outer()
    raised = failure.watched(model, lambda: forward(model, torch.randn(2, 4), FP16))
    assert (raised.op, raised.module, raised.module_type) == ("", "strict", "Strict")
    assert raised.error == "ValueError: expected float32, got torch.float16"


def test_not_the_models_failure_goes_on_as_it_was():
    model = Encoder()
    with pytest.raises(UserError):
        failure.watched(model, lambda: (_ for _ in ()).throw(UserError("params: a key")))
    assert not failure.under_policy(UserError("x")) and not failure.under_policy(MemoryError())
    assert not failure.under_policy(KeyboardInterrupt()) and failure.under_policy(RuntimeError("overflow"))
    assert devices.missing_kernel(RuntimeError("\"addmm\" not implemented for 'Half'"))
    assert not devices.missing_kernel(RuntimeError("value cannot be converted to type c10::Half without overflow"))


def test_the_first_case_is_the_first_row_that_raises_alone():
    torch.manual_seed(0)
    x = torch.randn(10, 4)
    x[6, 0] = 100.0
    ids = [f"ordinary-{i}" for i in range(10)]
    raised, case = failure.inference_raised(Loud, x, ids, FP16, CPU, eval_mode=True)
    assert (raised.op, raised.module, case) == ("torch.Tensor.masked_fill", "", "ordinary-6")
    assert failure.inference_raised(Loud, x, ids, BF16, CPU, eval_mode=True) is None


def params(**kw) -> Params:
    return Params(reference=ReferenceConfig(train_steps=5, batch_size=8, lr=0.01, checkpoint_every=0, **kw))


def test_a_training_failure_names_its_step():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    source = TensorSource(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    x, ids = torch.randn(4, 4), ["a", "b", "c", "d"]
    found = failure.locate(RuntimeError("overflow"), "training", TrainsBadly, TrainsBadly, source, x, ids, params(), FP16, CPU)
    assert (found.part, found.step, found.case, found.op, found.module) == ("training", 2, None, "torch.Tensor.masked_fill", "")
    # a failure the replay does not reproduce (bfloat16 holds -1e9) is none of the policy's: the trial re-raises it
    assert failure.locate(RuntimeError("overflow"), "training", TrainsBadly, TrainsBadly, source, x, ids, params(), BF16,
                          CPU) is None
    assert failure.locate(UserError("data"), "inference", Encoder, Encoder, source, x, ids, params(), FP16, CPU) is None


FAILED = trial.Failure(part="inference", error="RuntimeError: value cannot be converted to type c10::Half without overflow",
                       missing_kernel=False, op="torch.Tensor.masked_fill", module="encoder.attention", module_type="Attention",
                       dtype="float16", device="cpu", case="ordinary-3")


def test_the_failure_in_one_line_names_part_op_module_case_and_the_fix():
    assert FAILED.line("float16") == (
        "inference: the model raised under float16 autocast on cpu in op torch.Tensor.masked_fill of module "
        "'encoder.attention' (Attention) on case ordinary-3: RuntimeError: value cannot be converted to type c10::Half "
        "without overflow; keep that module in FP32 (trial.policies.float16.fp32_modules: [encoder.attention]) or trial "
        "another dtype"
    )
    lstm = dataclasses.replace(FAILED, part="training", missing_kernel=True, op="torch.lstm", module="lstm", module_type="LSTM",
                               case=None, step=0)
    assert lstm.line("float16").startswith("training: the model has no float16 kernel on cpu in op torch.lstm of module "
                                           "'lstm' (LSTM) at step 0: ")
    assert trial.Failure.from_dict(FAILED.as_dict()) == FAILED and "step" not in FAILED.as_dict()


def test_a_failed_trial_is_a_verified_folder_with_no_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = paths.trial("float16")
    folder.mkdir(parents=True)
    (folder / paths.TRIAL_OUTPUTS).write_bytes(b"an earlier run's")  # stale: goes
    ref = types.SimpleNamespace(run_key="k" * 64, rule_sha256="r" * 64, env={"backend": "cpu"})  # what fail reads of it
    writer = trial_tensors.Writer("float16", ["a"])
    manifest = writer.fail(FAILED, FP16, ref, {"backend": "cpu"})
    assert sorted(p.name for p in folder.iterdir()) == [trial.FAILURE, paths.TRIAL_MANIFEST]
    assert trial.read_manifest("float16") == manifest and manifest.failed and manifest.env_differs_from_reference == []
    assert trial.read_failure("float16") == FAILED
    with pytest.raises(UserError, match="failed trial"):
        trial_tensors.load("float16")
    (folder / trial.FAILURE).write_text("{}")  # the manifest's sha256 catches an edit
    with pytest.raises(UserError):
        trial.read_failure("float16")


def test_decide_rolls_a_failed_trial_back_and_every_renderer_copes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/ here: the child run finds no checkpoint, as for a failed trial
    from test_page import blank

    from pipeline.artifacts import decision, diagnosis, variant
    from pipeline.artifacts.benchmark import NotBenchmarked
    from pipeline.artifacts.reference import Manifest
    from pipeline.present import page, runs, verdict

    found = diagnosis.of_failure(FAILED)
    assert found.suggestion.fp32_modules == ("encoder.attention",) and "op torch.Tensor.masked_fill" in found.findings[0]
    d = decision.of_failure("float16", FAILED, findings=found.findings, notes=[], rule={}, rule_sha256="r", policy={},
                            env={}, rollback_package="data/decision/float16/rollback")
    assert (d.decision, d.inference, d.training, d.reasons, d.cases) == (
        "rollback", "rollback", "rollback", [FAILED.line("float16")], {"raised": ["ordinary-3"]})
    assert d.notes == ["training was not judged: the trial stopped when its inference raised"]
    assert decision.summary_metrics(d, None) == {"decision": "rollback", "reasons": 1}  # the criterion; not the finding
    # variant.load of a failed trial: no statistics, audit, trajectory, table or figures
    v = variant.Variant("float16", blank(trial.TrialManifest, policy={"dtype": "float16"}), d, found,
                        NotBenchmarked("float16", "rolled back"))
    said = verdict.text(verdict.verdict("float16", v.decision, None, v.diagnosis))
    assert FAILED.line("float16") in said and "fp32_modules=[\"encoder.attention\"]" in said, said
    assert runs.child_tags(v, [], {})["amp_engaged"] == "trial failed" and runs.columns(v)["accepted"] is False
    child = runs.child(v, verdict.verdict("float16", v.decision), [], (), None, {}, {})
    assert child.steps["loss_amp"] == [] and child.tables == {} and child.models == []
    reference = blank(Manifest, rule_sha256="r", run_key="k")
    assert "ROLLBACK" in page.markdown(reference, [v]) and "ROLLBACK" in page.html(reference, [v])
