"""Issue 14 on the CPU for real: 2 ranks under torchrun + gloo, DDP, a forced overflow, kills and resumes.

Everything runs real processes: `dvc repro` of a tiny project with `distributed.nproc_per_node: 2`, the
stages under `python -m torch.distributed.run`, and two gloo ranks spawned by torch.multiprocessing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import faults
from _project import dvc, env_for, run
from conftest import make_project

pytestmark = pytest.mark.integration

# TINY (12 steps, a resume state every 4: kills at 6 resume from 4; float16 accepted, bfloat16 rolled back)
# on 2 ranks, without the diagnosis's re-runs.
TWO = {"distributed": {"nproc_per_node": 2}, "diagnose": {"search_budget": 0}}
REFERENCE = (
    "init.safetensors", "checkpoint.safetensors", "cases.safetensors", "outputs.safetensors", "trajectory.json", "manifest.json",
)
TRIAL = ("outputs.safetensors", "trained_outputs.safetensors", "checkpoint.safetensors", "trajectory.json", "manifest.json")


def digests(folder: Path, names) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """A tiny project reproduced to a decision in both dtypes with 2 gloo ranks (read-only for tests)."""
    repo = make_project(tmp_path_factory.mktemp("ddp") / "repo", TWO)
    dvc(repo, "repro", "decide@float16", "decide@bfloat16")
    return repo


def test_dvc_repro_with_two_ranks_reaches_a_decision_in_both_dtypes(two_ranks):
    for dtype in ("float16", "bfloat16"):
        metrics = json.loads((two_ranks / f"data/metrics/{dtype}.json").read_text())
        assert metrics["decision"] in ("accept", "rollback")
        manifest = json.loads((two_ranks / f"data/trial/{dtype}/manifest.json").read_text())
        assert manifest["env"]["world_size"] == 2 and manifest["env"]["process_group_backend"] == "gloo"
    ref = json.loads((two_ranks / "data/reference/manifest.json").read_text())
    assert ref["env"]["world_size"] == 2 and ref["env"]["process_group_backend"] == "gloo"
    assert not any((two_ranks / "data/resume").glob("*"))  # rank 0 cleared every resume state


def test_the_benchmark_times_two_ranks_and_rank_0_writes_it(two_ranks, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(two_ranks, repo, symlinks=True)
    accepted = [
        d for d in ("float16", "bfloat16") if json.loads((repo / f"data/metrics/{d}.json").read_text())["decision"] == "accept"
    ]
    assert accepted, "TINY's tolerance accepts float16 (README: the same rule on 2 ranks)"
    run([sys.executable, "-m", "pipeline", "benchmark", "--variant", accepted[0]], repo)
    record = json.loads((repo / f"data/benchmark/{accepted[0]}/benchmark.json").read_text())
    assert record["benchmarked"] and record["env"]["world_size"] == 2 and record["env"]["process_group_backend"] == "gloo"


@pytest.mark.parametrize(("stage", "folder", "names", "rank"), [
    (["freeze"], "data/reference", REFERENCE, 1),  # a rank other than the writer dies
    (["trial", "--variant", "float16"], "data/trial/float16", TRIAL, 0),  # the writer itself dies
])
def test_a_rank_killed_mid_run_is_one_line_and_the_rerun_is_byte_identical(two_ranks, tmp_path, stage, folder, names, rank):
    repo = tmp_path / "repo"
    shutil.copytree(two_ranks, repo, symlinks=True)
    expected = digests(repo / folder, names)
    shutil.rmtree(repo / folder)  # as DVC does before running a stage
    env = faults.after_step(env_for(repo), 6, rank=rank)
    killed = run([sys.executable, "-m", "pipeline", *stage], repo, check=False, env=env)
    assert killed.returncode == 2
    line = killed.stderr.strip()
    assert line.count("\n") == 0 and f"rank {rank} of 2 died (killed by SIGKILL)" in line, killed.stderr[-2000:]
    assert not any((repo / folder / n).exists() for n in names)  # nothing half-written
    assert any((repo / "data/resume").glob("*.safetensors"))  # rank 0 saved step 4

    run([sys.executable, "-m", "pipeline", *stage], repo)
    assert digests(repo / folder, names) == expected
    assert not any((repo / "data/resume").glob("*"))


def _overflow_rank(rank: int, rendezvous: str, out: str, wrap: bool) -> None:
    import torch.distributed as dist

    from pipeline import distributed, precision, recipe, training
    from pipeline.config import TaskConfig
    from pipeline.config import Policy

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    world = distributed.World(rank=rank, size=2, backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    net = world.wrap(model, torch.device("cpu")) if wrap else model
    policy = Policy(dtype="float16")
    scaler = precision.make_scaler(policy, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)
    if rank == 1:
        x[0, 0] = 1e5  # beyond float16's 65504: only rank 1's own gradients overflow
    y = torch.tensor([0, 1])
    step = training.amp_step(net, [(x, y)], recipe.make_loss(TaskConfig()), optimizer, scaler, policy, torch.device("cpu"))
    Path(out).with_name(f"rank{rank}.json").write_text(json.dumps({"skipped": step.skipped, "scale": scaler.get_scale()}))
    dist.destroy_process_group()


def _spawn(tmp_path: Path, wrap: bool) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_overflow_rank, args=(str(tmp_path / "rdv"), str(tmp_path / "x"), wrap), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_grad_scaler_skips_on_every_rank_when_one_rank_overflows(tmp_path):
    """DDP all-reduces the gradients before ``unscale_`` looks for inf/NaN: every rank sees rank 1's
    overflow, skips the step and halves its scale. Without DDP (the control) rank 0 would step alone."""
    (tmp_path / "ddp").mkdir()
    (tmp_path / "alone").mkdir()
    ddp = _spawn(tmp_path / "ddp", wrap=True)
    assert [r["skipped"] for r in ddp] == [True, True]
    assert ddp[0]["scale"] == ddp[1]["scale"] == 2.0**15
    alone = _spawn(tmp_path / "alone", wrap=False)
    assert [r["skipped"] for r in alone] == [False, True]
