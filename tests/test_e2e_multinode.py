"""Multi-node on one machine (issue 52 item 5): two "nodes" of one process each on 127.0.0.1 meet at torchrun's c10d
rendezvous and reach the same bytes as one node with world size 2.

The same `dvc repro` of a tiny project twice: once with ``nproc_per_node: 2`` (``torchrun --standalone``), once with
``nnodes: 2, nproc_per_node: 1`` and a rendezvous on 127.0.0.1, whose ``launcher`` (tests/_two_nodes.py, in the role
``srun --ntasks-per-node=1`` plays on a cluster) starts the same torchrun command twice, as on two nodes.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _project import dvc, env_for, stage
from conftest import make_project

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parent
ONLY = {"trial": {"variants": ["float16"]}, "diagnose": {"search_budget": 0}}
REFERENCE = ("init.safetensors", "checkpoint.safetensors", "cases.safetensors", "outputs.safetensors", "trajectory.json",
             "manifest.json")
TRIAL = ("outputs.safetensors", "trained_outputs.safetensors", "checkpoint.safetensors", "trajectory.json", "manifest.json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digests(repo: Path, trial: bool = True) -> dict[str, str]:
    files = [f"data/reference/{n}" for n in REFERENCE] + [f"data/trial/float16/{n}" for n in TRIAL if trial]
    return {f: hashlib.sha256((repo / f).read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The tiny project reproduced to trial@float16 on one node with 2 ranks."""
    one = make_project(tmp_path_factory.mktemp("one") / "repo", {**ONLY, "distributed": {"nproc_per_node": 2}})
    dvc(one, "repro", "trial@float16")
    return one


def two_nodes(launcher: list[str]) -> dict:
    return {**ONLY, "distributed": {"nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}",
                                    "launcher": launcher}}


def test_dvc_repro_on_two_nodes_under_a_rendezvous_reaches_one_nodes_bytes(one_node, tmp_path):
    two = make_project(tmp_path / "two", two_nodes([sys.executable, str(TESTS / "_two_nodes.py")]))
    out = dvc(two, "repro", "trial@float16").stdout
    assert '"world_size": 2' in (two / "data/reference/manifest.json").read_text()
    assert digests(two) == digests(one_node), out


def test_the_same_stage_command_on_each_node_without_a_launcher(one_node, tmp_path):
    """No launcher: each "node" runs `python -m pipeline freeze` itself (what a user types on each machine)."""
    repo = make_project(tmp_path / "repo", two_nodes([]))
    dvc(repo, "repro", "prepare")
    nodes = [subprocess.Popen([sys.executable, "-m", "pipeline", "freeze"], cwd=repo, env=env_for(repo),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs
    reference = {f: d for f, d in digests(one_node).items() if f.startswith("data/reference/")}
    assert digests(repo, trial=False) == reference


def test_a_missing_endpoint_is_one_line(tmp_path):
    repo = make_project(tmp_path / "repo", {**ONLY, "distributed": {"nnodes": 2}})
    run = stage(repo, "freeze")
    assert run.returncode == 2 and "distributed.rdzv_endpoint is null" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
