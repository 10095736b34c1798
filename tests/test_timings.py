"""scripts/timings.py's cost of a verdict: the necessary trainings read from what the stages print, the rest accounted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def timings():
    spec = importlib.util.spec_from_file_location("timings", ROOT / "scripts" / "timings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FREEZE = [  # as freeze and training.Progress print them (a run of the default example)
    "freeze FP32: 60 steps in 0.26 s",
    "freeze FP32 replicate: 60 steps in 0.27 s",
    "freeze: reference trained 60 steps, final loss 0.1853; FP32 replicate final loss 0.1719; 275 cases; "
    "FP64 arbiter on 275 of them",
    "  freeze seconds: reference training 3.69, replicate training 0.66, boundary cases 0.12, fp64 arbiter 0.01, "
    "forecast 0.21, inference 0.01, writing 0.10",
]


def test_the_trainings_are_the_loops_and_the_rest_adds_up(timings):
    run = timings.Run(
        total=30.0,
        stages={"prepare": 2.0, "freeze": 9.0, "trial@float16": 4.0, "trial@bfloat16": 5.0, "compare@float16": 3.0},
        lines={"prepare": ["prepare: 267 cases"], "freeze": FREEZE,
               "trial@float16": ["trial float16: 60 steps in 0.71 s", "trial float16 FP32 aligned on skips: 60 steps in 0.30 s"],
               "trial@bfloat16": ["\rtrial bfloat16: step 60/60 loss 0.2 scale 1 skipped 0 90.0 step/s ETA 0s\x1b[K",
                                  "trial bfloat16: 60 steps in 0.91 s"]},
        imports={}, all_imports={"prepare": 1.0, "freeze": 2.5, "trial@float16": 2.0, "trial@bfloat16": 2.0},
    )
    cost = timings.cost_of_verdict(run, rewrite_s=0.1)
    assert cost.trainings == {"reference": 0.26, "replicate": 0.27, "trial float16": 0.71, "trial bfloat16": 0.91}
    assert cost.missing == ()
    assert cost.ratio == pytest.approx(30.0 / 2.15)
    assert sum(cost.trainings.values()) + sum(cost.rest.values()) == pytest.approx(30.0)
    assert cost.rest["freeze: fp64 arbiter"] == 0.01 and cost.rest["trial: FP32 aligned on skips"] == 0.30
    assert cost.rest["imports (every stage process)"] == pytest.approx(7.5)
    assert cost.rest["dvc.lock rewrites"] == pytest.approx(0.5) and cost.rest["dvc, outside the stages"] == pytest.approx(7.0)
    # freeze's window less its imports, lock rewrite, loops and other phases: setup outside the loops, start, writing
    assert cost.rest["freeze: the rest"] == pytest.approx(9.0 - 2.5 - 0.1 - 0.53 - 0.45)


def test_a_training_no_stage_timed_is_named_not_guessed(timings):
    run = timings.Run(total=10.0, stages={"freeze": 6.0, "trial@float16": 4.0}, lines={"freeze": FREEZE[2:]},
                      imports={}, all_imports={})
    cost = timings.cost_of_verdict(run, rewrite_s=0.0)
    assert cost.trainings == {"reference": 3.69, "replicate": 0.66}  # freeze's phases, setup included
    assert cost.missing == ("trial float16",) and cost.rest["trial: the rest"] == 4.0


def test_a_stages_import_lines_are_its_imports_and_not_its_output(timings):
    raw = {"freeze": ["import time: self [us] | cumulative | imported package\n",
                      "import time:       120 |    1500000 | torch\n",
                      "import time:        80 |      40000 |   torch._dynamo\n",
                      "import time:        10 |     250000 | pipeline.stages.freeze\n",
                      "freeze FP32: 60 steps in 0.26 s\n"],
           "decide": ["decide: ACCEPT\n"]}
    run = timings.of_stages(4.0, {"freeze": 3.0, "decide": 1.0}, raw)
    assert run.lines == {"freeze": ["import time: self [us] | cumulative | imported package", "freeze FP32: 60 steps in 0.26 s"],
                         "decide": ["decide: ACCEPT"]}
    assert run.all_imports == {"freeze": pytest.approx(1.75)}  # top-level imports only: torch._dynamo is inside torch's
    assert run.imports["torch"] == {"freeze": 1.5} and run.imports["torch._dynamo"] == {"freeze": 0.04}
    assert timings.cost_of_verdict(run, rewrite_s=0.0).trainings == {"reference": 0.26}
