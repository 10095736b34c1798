"""NCCL and FSDP2 on a GPU (issue 52): the GPU CI runs these, and so does a session lent a device (scripts/gpu_proof.sh).

The ranks: two where two GPUs are visible, through params (``distributed.nproc_per_node: 2``: the stages start torchrun
themselves, one rank per GPU). With one GPU, freeze and the trials run under ``torchrun --nproc_per_node 1`` by hand,
which makes an NCCL group of one rank (``distributed.init``): DDP then wraps nothing, but FSDP2 shards over the
one-rank mesh, gathers the full state, casts its parameters and agrees on the GradScaler's skips through NCCL as on N.
Each project is the tiny digits example on ``device: cuda``, run stage by stage in dvc.yaml's order (``_project.plan``):
no dvc, git or MLflow, so a PyTorch image with scikit-learn (the digits data) runs these. The CPU twin of every check
is tests/test_e2e_fsdp.py (gloo ranks through `dvc repro`); ``check_ranks(tmp, "cpu", "gloo", n)`` also runs on the CPU,
by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import _project
from _project import env_for, run
from conftest import TINY

pytestmark = pytest.mark.gpu

QUICK = {"diagnose": {"search_budget": 0}}
MIXED = {"dtype": "float32", "fsdp_param_dtype": "bfloat16", "fsdp_reduce_dtype": "float32"}
TRAINING = ("freeze", "trial")
"""The stages that train, hence start ranks (launch.relaunched)."""


def ranks() -> int:
    """Two where two GPUs are visible, else one (by hand: see the module's text)."""
    return 2 if torch.cuda.device_count() >= 2 else 1


def reproduce(repo: Path, variants: tuple[str, ...], by_hand: bool) -> dict[str, str]:
    """Every stage up to decide, in dvc.yaml's order, for ``variants``; ``by_hand``: the training stages under
    ``torchrun --nproc_per_node 1``. Returns each stage's stdout, by name."""
    out = {}
    wanted = {"prepare", "freeze"} | {f"{s}@{v}" for v in variants for s in ("trial", "compare", "diagnose", "decide")}
    for step in _project.plan(_project.params(repo), repo):
        if step.name not in wanted:
            continue
        argv = step.argv()
        if by_hand and step.cmd[3] in TRAINING:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *argv[1:]]
        out[step.name] = run(argv, repo, env={**env_for(repo), "OMP_NUM_THREADS": "1"}).stdout
    return out


def project(dest: Path, device: str, override: dict, n: int) -> Path:
    """The tiny project on ``device``; ``n`` == 2: two ranks through params."""
    spread = {"distributed": {"nproc_per_node": 2}} if n == 2 else {}
    return _project.copy(dest, override=_project.merge(_project.merge(TINY, {**QUICK, "device": device}),
                                                      _project.merge(override, spread)))


def decision(repo: Path, variant: str) -> dict:
    return json.loads((repo / f"data/decision/{variant}/decision.json").read_text())


def manifest(repo: Path, folder: str) -> dict:
    return json.loads((repo / folder / "manifest.json").read_text())


def final_loss(repo: Path) -> float:
    """The reference's mean loss over its last quarter of steps."""
    steps = json.loads((repo / "data/reference/trajectory.json").read_text())["steps"]
    last = steps[-max(1, len(steps) // 4):]
    return sum(s["loss"] for s in last) / len(last)


def check_ranks(tmp_path: Path, device: str, backend: str, n: int) -> None:
    """DDP, then FSDP2 with an autocast variant and one of FSDP2's own mixed precision, on ``n`` ranks of ``backend``:
    the decisions one process reaches, the manifests saying what ran, one frozen rule for every variant."""
    by_hand = n == 1
    alone = project(tmp_path / "alone", device, {"trial": {"variants": ["float16", "bfloat16"]}}, 1)
    reproduce(alone, ("float16", "bfloat16"), by_hand=False)

    ddp = project(tmp_path / "ddp", device, {"trial": {"variants": ["float16"]}}, n)
    reproduce(ddp, ("float16",), by_hand)
    for folder in ("data/reference", "data/trial/float16"):
        env = manifest(ddp, folder)["env"]
        assert (env["world_size"], env["process_group_backend"], env.get("distributed_strategy")) == (n, backend, None)
    assert decision(ddp, "float16")["decision"] == decision(alone, "float16")["decision"]

    fsdp = project(tmp_path / "fsdp", device, {"distributed": {"strategy": "fsdp"}, "trial": {
        "variants": ["bfloat16", "fsdp_bf16"], "policies": {"fsdp_bf16": MIXED}}}, n)
    out = reproduce(fsdp, ("bfloat16", "fsdp_bf16"), by_hand)
    assert f"FSDP2 over {n} ranks ({backend}):" in out["freeze"], out["freeze"]
    for folder in ("data/reference", "data/trial/bfloat16", "data/trial/fsdp_bf16"):
        env = manifest(fsdp, folder)["env"]
        assert (env["world_size"], env["process_group_backend"], env["distributed_strategy"]) == (n, backend, "fsdp")
    assert decision(fsdp, "bfloat16")["decision"] == decision(alone, "bfloat16")["decision"]
    mixed, autocast = decision(fsdp, "fsdp_bf16"), decision(fsdp, "bfloat16")
    assert mixed["decision"] in ("accept", "rollback") and mixed["rule_sha256"] == autocast["rule_sha256"]
    assert {k: manifest(fsdp, "data/trial/fsdp_bf16")["policy"][k] for k in MIXED} == MIXED
    audit = json.loads((fsdp / "data/trial/fsdp_bf16/audit.json").read_text())
    assert list(audit["by_precision"]) == ["bfloat16"], audit["by_precision"]  # every matmul in bfloat16
    assert final_loss(fsdp) == pytest.approx(final_loss(alone), rel=0.05)  # FSDP2's FP32 reference: the same training


def test_nccl_ddp_and_fsdp2_reach_the_decisions_of_one_process_on_the_gpu(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the digits example reads scikit-learn's bundled data")
    check_ranks(tmp_path, "cuda", "nccl", ranks())
