"""pipeline/distributed.py and pipeline/launch.py without starting ranks: launch checks, the batch split, torchrun's
failure lines."""

from __future__ import annotations

import pytest
import torch
import yaml

from pipeline import __main__ as cli
from pipeline import distributed, launch
from pipeline.config import load_params
from pipeline.errors import UserError


def params_file(tmp_path, **sections):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(sections))
    return str(path)


def test_one_process_is_the_default_and_changes_nothing(tmp_path):
    params = load_params(params_file(tmp_path))
    assert params.distributed.nproc_per_node == 1
    assert not launch.relaunched("freeze", params, "params.yaml")
    world = distributed.World()
    idx = torch.arange(8)
    model = torch.nn.Linear(2, 2)
    assert world.shard(idx) is idx and world.wrap(model, torch.device("cpu")) is model
    assert world.key("k") == "k" and world.describe() == {}
    loss = torch.tensor(1.5)
    assert world.mean(loss) is loss


def test_a_zero_nproc_is_refused(tmp_path):
    with pytest.raises(UserError, match="distributed.nproc_per_node is 0"):
        load_params(params_file(tmp_path, distributed={"nproc_per_node": 0}))


def test_each_rank_takes_a_contiguous_slice_of_every_micro_batch():
    idx = torch.tensor([7, 3, 9, 1, 4, 0])
    shards = [distributed.World(rank=r, size=3).shard(idx).tolist() for r in range(3)]
    assert shards == [[7, 3], [9, 1], [4, 0]]
    assert distributed.World(rank=1, size=2).key("k") == "k/world2"
    with pytest.raises(UserError, match="does not split over distributed.nproc_per_node 4"):
        distributed.World(rank=0, size=4).shard(idx)


def test_a_batch_size_the_ranks_do_not_divide_is_one_line_exit_2(tmp_path, capsys):
    path = params_file(tmp_path, distributed={"nproc_per_node": 2}, reference={"batch_size": 31})
    assert cli.main(["freeze", "--params", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "distributed.nproc_per_node 2 does not divide reference.batch_size 31" in err


def test_more_ranks_than_visible_gpus_is_one_line(tmp_path, monkeypatch, capsys):
    from pipeline import devices

    monkeypatch.setattr(devices, "resolve", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    path = params_file(tmp_path, device="cuda", distributed={"nproc_per_node": 2}, reference={"batch_size": 32})
    assert cli.main(["trial", "--variant", "float16", "--params", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "distributed.nproc_per_node is 2 but 1 GPU(s) are visible" in err


def test_a_rank_never_launches_again(tmp_path, monkeypatch):
    """Only the stages that train call the launcher (tests/test_deps.py derives that); inside a rank it is a no-op."""
    params = load_params(params_file(tmp_path, distributed={"nproc_per_node": 2}))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not launch.relaunched("freeze", params, "params.yaml")


TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
pipeline FAILED
------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 6195)  (SIGTERM)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 6196)  (SIGKILL)
======================================================
"""


def test_failure_lines_name_the_rank_that_died_or_its_own_error():
    line = launch.failure_line(TORCHRUN_REPORT, 2, "freeze")
    assert "rank 1 of 2 died (killed by SIGKILL)" in line and "\n" not in line
    own = "[rank0]: noise\nerror: --variant float8 is not in trial.variants; add it\n" + TORCHRUN_REPORT
    assert launch.failure_line(own, 2, "trial") == "--variant float8 is not in trial.variants; add it"
    assert "torchrun failed (boom)" in launch.failure_line("boom\n", 2, "freeze")


def test_gpu_workflow_pulls_the_shared_reference_before_the_pipeline_when_a_remote_is_configured():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    steps = yaml.safe_load((root / ".github/workflows/gpu.yml").read_text())["jobs"]["pipeline"]["steps"]
    names = [s.get("name", "") for s in steps]
    pull = next(i for i, n in enumerate(names) if "Pull the shared frozen reference" in n)
    assert pull < next(i for i, n in enumerate(names) if n.startswith("dvc repro"))
    assert "vars.DVC_REMOTE_URL != ''" in steps[pull]["if"]
    assert "sh scripts/pull_reference.sh" in steps[pull]["run"]
    assert (root / "scripts/pull_reference.sh").is_file()
