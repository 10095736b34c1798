"""FSDP2 (``distributed.strategy: fsdp``, issue 52 item 3) on the CPU for real: 2 gloo ranks under torchrun through
`dvc repro` of the tiny digits project reach the decisions one process reaches, a rank killed mid-run resumes to
the same bytes on that world size (the DDP test's pattern, tests/test_e2e_distributed.py), and the benchmark times
the sharded training the trials ran (FSDP2's mixed precision as itself)."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

import _project
import faults
from _project import dvc, env_for, run
from conftest import make_project
from pipeline import torch_compat
from test_benchmark import decide

pytestmark = pytest.mark.integration
trains = pytest.mark.skipif(not torch_compat.fsdp2_runs_on_cpu(), reason="this torch's FSDP2 runs on CUDA only (torch 2.4, "
                                                                          "2.5): the stage refuses in one line (test_fsdp.py)")

QUICK = {"diagnose": {"search_budget": 0}}
FSDP = {**QUICK, "distributed": {"nproc_per_node": 2, "strategy": "fsdp"}}
DTYPES = ("float16", "bfloat16")
REFERENCE = (
    "init.safetensors", "checkpoint.safetensors", "cases.safetensors", "outputs.safetensors", "trajectory.json", "manifest.json",
)
TRIAL = ("outputs.safetensors", "trained_outputs.safetensors", "checkpoint.safetensors", "trajectory.json", "manifest.json")


def digests(folder: Path, names) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}


def decisions(repo: Path) -> dict[str, str]:
    return {d: json.loads((repo / f"data/metrics/{d}.json").read_text())["decision"] for d in DTYPES}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The tiny digits project reproduced to a decision in both dtypes by FSDP2 on 2 gloo ranks (read-only for tests)."""
    repo = make_project(tmp_path_factory.mktemp("fsdp") / "repo", FSDP)
    out = dvc(repo, "repro", *(f"decide@{d}" for d in DTYPES)).stdout
    assert out.count("FSDP2 over 2 ranks (gloo): 4 blocks (LayerNorm, Linear) and the root") == 3, out  # freeze, 2 trials
    return repo


@trains
def test_fsdp_on_two_ranks_reaches_the_decisions_of_one_process(sharded, tmp_path):
    alone = make_project(tmp_path / "alone", QUICK)
    dvc(alone, "repro", *(f"decide@{d}" for d in DTYPES))
    assert decisions(sharded) == decisions(alone) == {"float16": "accept", "bfloat16": "rollback"}  # TINY's two verdicts
    for folder in ("data/reference", *(f"data/trial/{d}" for d in DTYPES)):
        env = json.loads((sharded / folder / "manifest.json").read_text())["env"]
        assert (env["world_size"], env["process_group_backend"], env["distributed_strategy"]) == (2, "gloo", "fsdp"), folder
    ones = json.loads((alone / "data/reference/trajectory.json").read_text())
    twos = json.loads((sharded / "data/reference/trajectory.json").read_text())
    assert json.dumps(ones) != json.dumps(twos)  # really another run (its own reductions), yet the same verdicts
    assert not any((sharded / "data/resume").glob("*"))  # rank 0 cleared every resume state


@trains
@pytest.mark.parametrize(("stage", "target", "folder", "names", "rank"), [
    (["freeze"], "freeze", "data/reference", REFERENCE, 1),  # a rank other than the writer dies
    (["trial", "--variant", "float16"], "trial@float16", "data/trial/float16", TRIAL, 0),  # the writer dies (GradScaler)
])
def test_a_rank_killed_mid_run_resumes_to_the_same_bytes(sharded, tmp_path, stage, target, folder, names, rank):
    label = "freeze FP32" if target == "freeze" else "trial float16"
    repo = tmp_path / "repo"
    shutil.copytree(sharded, repo, symlinks=True)
    expected = digests(repo / folder, names)
    shutil.rmtree(repo / folder)  # as DVC does before running a stage
    env = faults.after_step(env_for(repo), 6, rank=rank)
    killed = run([sys.executable, "-m", "pipeline", *stage], repo, check=False, env=env)
    assert killed.returncode == 2
    line = killed.stderr.strip()
    assert line.count("\n") == 0 and f"rank {rank} of 2 died (killed by SIGKILL)" in line, killed.stderr[-2000:]
    assert not any((repo / folder / n).exists() for n in names)  # nothing half-written
    assert any((repo / "data/resume").glob("*.safetensors"))  # rank 0 saved step 4, gathered from both ranks' shards

    out = dvc(repo, "repro", "--force", "--single-item", target).stdout  # runs it (no DVC cache copy): resumes at step 4
    assert f"Running stage '{target}'" in out and f"{label}: 8 steps in" in out, out  # steps 5 to 12 only
    assert digests(repo / folder, names) == expected
    assert not any((repo / "data/resume").glob("*"))  # the resumed run finished and cleared its state


@trains
def test_the_benchmark_times_fsdp2_as_the_trials_train(sharded, tmp_path):
    """benchmark@float16 (accepted on TINY) under FSDP2: every arm a sharded copy on the 2 gloo ranks, as the trials
    trained; the record says so, in its env and its method, with a finite speedup and memory ratio."""
    repo = tmp_path / "repo"
    shutil.copytree(sharded, repo, symlinks=True)
    done = dvc(repo, "repro", "benchmark@float16")
    assert "Running stage 'benchmark@float16'" in done.stdout and "Running stage 'trial" not in done.stdout, done.stdout
    assert "FSDP2 over 2 ranks (gloo): 4 blocks (LayerNorm, Linear) and the root" in done.stdout, done.stdout
    assert "times DDP" not in done.stderr, done.stderr  # the warning went with the DDP workload
    record = json.loads((repo / "data/benchmark/float16/benchmark.json").read_text())
    assert record["benchmarked"]
    env = record["env"]
    assert (env["world_size"], env["process_group_backend"], env["distributed_strategy"]) == (2, "gloo", "fsdp"), env
    fsdp = record["method"]["fsdp"]
    assert fsdp.startswith("FSDP2 (fully_shard) on 2 ranks (gloo), as the trials train: every arm a sharded copy"), fsdp
    assert fsdp.endswith("the amp arm's parameters in its forward: float32"), fsdp  # autocast casts op by op
    speedup, ratio = record["speedup"]["median"], record["memory_ratio"]["median"]
    assert math.isfinite(speedup) and speedup > 0 and math.isfinite(ratio) and ratio > 0, (speedup, ratio)


@trains
def test_fsdp_by_block_class_on_the_tiny_transformer_reaches_the_decisions_of_one_process(tmp_path):
    """The transformer example sharded per encoder block (``fsdp_blocks: [Block]``), then the root (embedding,
    positions, norm, head): the verdicts one process reaches."""
    base = _project.merge(_project.transformer("tiny"), QUICK)
    alone = make_project(tmp_path / "alone", base)
    sharded = make_project(tmp_path / "fsdp", _project.merge(base, {"distributed": {
        "nproc_per_node": 2, "strategy": "fsdp", "fsdp_blocks": ["Block"]}}))
    dvc(alone, "repro", *(f"decide@{d}" for d in DTYPES))
    out = dvc(sharded, "repro", *(f"decide@{d}" for d in DTYPES)).stdout
    assert "FSDP2 over 2 ranks (gloo): 1 blocks (Block) and the root" in out, out
    assert decisions(sharded) == decisions(alone), (decisions(sharded), decisions(alone))


MIXED = {"dtype": "float32", "fsdp_param_dtype": "bfloat16", "fsdp_reduce_dtype": "float32"}


@trains
def test_fsdp_mixed_precision_runs_beside_autocast_in_one_repro_judged_by_the_same_rule(tmp_path):
    """Issue 52 item 4: a variant of FSDP2's own mixed precision (bfloat16 parameters for every op, gradients reduced in
    FP32) beside autocast's bfloat16, in one `dvc repro`, each with a verdict under the one frozen rule."""
    repo = make_project(tmp_path / "repo", _project.merge(FSDP, {"trial": {
        "variants": ["bfloat16", "fsdp_bf16"], "policies": {"fsdp_bf16": MIXED}}}))
    out = dvc(repo, "repro", "decide@bfloat16", "decide@fsdp_bf16").stdout
    judged = {v: json.loads((repo / f"data/decision/{v}/decision.json").read_text()) for v in ("bfloat16", "fsdp_bf16")}
    assert judged["fsdp_bf16"]["decision"] in ("accept", "rollback"), out
    assert judged["fsdp_bf16"]["rule_sha256"] == judged["bfloat16"]["rule_sha256"]
    manifest = json.loads((repo / "data/trial/fsdp_bf16/manifest.json").read_text())
    assert {k: manifest["policy"][k] for k in MIXED} == MIXED  # what ran, recorded
    audit = json.loads((repo / "data/trial/fsdp_bf16/audit.json").read_text())
    assert list(audit["by_precision"]) == ["bfloat16"], audit["by_precision"]  # the audit: every matmul ran in bfloat16
    assert audit["reference_reduced_share"] == 0.0 and not audit["flagged"]  # against the FP32 reference, traced uncast
    assert judged["fsdp_bf16"]["decision"] == judged["bfloat16"]["decision"] == "rollback"  # TINY's atol: too tight for both
    found = json.loads((repo / "data/diagnose/fsdp_bf16/diagnosis.json").read_text())["findings"]
    assert found[0].startswith("not replayed: FSDP2's mixed precision (bfloat16 parameters)"), found  # nothing searched

    decide(repo, "fsdp_bf16", "accept")  # forced: only an accepted variant is benchmarked
    run([sys.executable, "-m", "pipeline", "benchmark", "--variant", "fsdp_bf16"], repo)
    record = json.loads((repo / "data/benchmark/fsdp_bf16/benchmark.json").read_text())
    assert record["method"]["fsdp"].endswith("parameters in its forward: bfloat16"), record["method"]  # timed as itself
    assert math.isfinite(record["speedup"]["median"]) and math.isfinite(record["memory_ratio"]["median"])


@trains
def test_healthy_fsdp_mixed_precision_is_accepted_under_the_projects_rule(tmp_path):
    """The other direction: under the project's own tolerances (params.yaml's atol 0.05, rtol 0.02), FSDP2's bfloat16
    parameters on the digits MLP pass every criterion, training's included (its audit once read the FP32 reference as
    100 % reduced and rolled it back on "nothing to gain")."""
    rule = {"acceptance": {"outputs": {"*": _project.params()["acceptance"]["outputs"]["*"]}}}
    repo = make_project(tmp_path / "repo", _project.merge(_project.merge(FSDP, rule), {"trial": {
        "variants": ["fsdp_bf16"], "policies": {"fsdp_bf16": MIXED}}}))
    out = dvc(repo, "repro", "decide@fsdp_bf16").stdout
    assert json.loads((repo / "data/decision/fsdp_bf16/decision.json").read_text())["decision"] == "accept", out


def test_fsdp_mixed_precision_without_fsdp_is_refused_in_one_line(tmp_path):
    repo = make_project(tmp_path / "repo", {**QUICK, "trial": {"variants": ["fsdp_bf16"], "policies": {"fsdp_bf16": MIXED}}})
    refused = run([sys.executable, "-m", "pipeline", "freeze"], repo, check=False)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "trial.policies.fsdp_bf16.fsdp_param_dtype is FSDP2's mixed precision, but distributed.strategy is 'ddp'" in \
        refused.stderr


def test_a_block_class_the_model_lacks_is_one_line(tmp_path):
    repo = make_project(tmp_path / "repo", _project.merge(FSDP, {"distributed": {"fsdp_blocks": ["BertLayer"]}}))
    dvc(repo, "repro", "prepare")
    refused = run([sys.executable, "-m", "pipeline", "freeze"], repo, check=False)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "distributed.fsdp_blocks names 'BertLayer', no class of the model's modules; use some of LayerNorm, Linear" in \
        refused.stderr
