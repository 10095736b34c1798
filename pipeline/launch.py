"""Start a training stage on N ranks under torchrun (params ``distributed.nproc_per_node`` > 1 or ``nnodes`` > 1).

With ``nproc_per_node: N`` > 1, ``python -m pipeline freeze|trial|benchmark`` starts itself again as
``python -m torch.distributed.run --standalone --nproc_per_node N -m pipeline ...`` (``relaunched``): the
dvc.yaml command stays the same. Only the stages that train call it, so the others never import it, nor
pipeline.devices through it. pipeline/distributed.py is each rank's side.

With ``nnodes: M`` > 1, ``--standalone`` gives way to torchrun's c10d rendezvous at ``rdzv_endpoint``: every node runs
the same stage command, each starting its torchrun agent, and the agents make M x N ranks of them. ``launcher`` (e.g.
``srun``) starts that command on every node; without one, the user does (docs/distributed-multinode.md).

A rank that dies takes the group down (torchrun stops the others), nothing is written, and the parent
prints one line and exits 2; rerunning resumes from rank 0's last saved state (``reference.checkpoint_every``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import torch

from pipeline import devices, distributed
from pipeline.errors import UserError


def check_launch(params, visible_gpus: int | None) -> None:
    """Refuse, in one line, what N ranks cannot run. ``visible_gpus`` is None when the run is on the CPU."""
    n, nodes = params.distributed.nproc_per_node, params.distributed.nnodes
    batch = params.reference.batch_size
    if batch % (n * nodes):
        ranks = (f"distributed.nproc_per_node {n}" if nodes == 1
                 else f"the world size {n * nodes} (distributed.nnodes {nodes} x nproc_per_node {n})")
        raise UserError(
            f"params.yaml: {ranks} does not divide reference.batch_size {batch} (each rank takes "
            f"batch_size/N rows of every micro-batch); use a batch_size that is a multiple of {n * nodes}"
        )
    if visible_gpus is not None and n > visible_gpus:
        raise UserError(
            f"params.yaml: distributed.nproc_per_node is {n} but {visible_gpus} GPU(s) are visible here (one rank per GPU); "
            f"set nproc_per_node to at most {visible_gpus}, or make more GPUs visible "
            f"(CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)"
        )


def check_mixed_precision(params) -> None:
    """Refuse, in one line, a listed variant with FSDP2's mixed precision (``fsdp_param_dtype``) where FSDP2 does not
    train: it would run FP32 and be judged as if it had not.

    Raises:
        UserError: naming the variant and the fix.
    """
    cfg = params.distributed
    if cfg.strategy == "fsdp" and (cfg.nproc_per_node * cfg.nnodes > 1 or distributed.in_torchrun()):
        return
    for name in params.trial.variants:
        if params.trial.policies[name].fsdp_param_dtype is not None:
            raise UserError(
                f"params.yaml: trial.policies.{name}.fsdp_param_dtype is FSDP2's mixed precision, but distributed.strategy is "
                f"{cfg.strategy!r} on {cfg.nproc_per_node * cfg.nnodes} rank(s); set distributed.strategy: fsdp with "
                f"nproc_per_node >= 2, or use an autocast dtype for this variant"
            )


def relaunched(stage: str, params, params_path: str, variant: str | None = None) -> bool:
    """Run ``python -m pipeline STAGE`` on N ranks under torchrun and wait for them: True when it did (this
    process has nothing left to do), False when this process runs the stage itself (N == 1, or already a rank).

    Raises:
        UserError: N ranks cannot run here, or a rank failed (its own one-line error, or how it died).
    """
    cfg = params.distributed
    n = cfg.nproc_per_node * cfg.nnodes
    check_mixed_precision(params)
    if n <= 1 or distributed.in_torchrun():
        return False
    device = devices.resolve(params.device)
    check_launch(params, torch.cuda.device_count() if device.type == "cuda" else None)
    argv = [stage, "--params", params_path, *(["--variant", variant] if variant else [])]
    cmd = torchrun_command(cfg, argv, "-".join(filter(None, ("amp", stage, variant))))
    proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, errors="replace")
    if proc.returncode != 0:
        line = failure_line(proc.stderr, n, " ".join(argv))
        if "(exit 1)" in line:  # a rank crashed on a bug (an uncaught exception): its traceback is kept
            sys.stderr.write(proc.stderr)
        raise UserError(line)
    sys.stderr.write(proc.stderr)
    return True


def torchrun_command(cfg, argv: list[str], rdzv_id: str) -> list[str]:
    """torchrun's command for ``python -m pipeline ARGV`` on this node (``cfg``: params.distributed): ``--standalone``
    on one node; on several, the c10d rendezvous at ``cfg.rdzv_endpoint`` under ``rdzv_id``, which every node derives
    alike from the stage and variant (the nodes meet stage by stage), after ``cfg.launcher``'s words."""
    if cfg.nnodes == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return [*(cfg.launcher if cfg.nnodes > 1 else []), sys.executable, "-m", "torch.distributed.run", *where,
            f"--nproc_per_node={cfg.nproc_per_node}", "-m", "pipeline", *argv]


_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)


def failure_line(stderr: str, n: int, what: str) -> str:
    """The one line for a failed torchrun: a rank's own ``error:`` line when it printed one, else which rank
    died and how (torchrun's "Root Cause" report), else torchrun's last line."""
    for line in stderr.splitlines():
        if line.startswith("error: "):
            return line[len("error: ") :]
    cause = stderr[stderr.rfind("Root Cause") :] if "Root Cause" in stderr else stderr  # not the ranks torchrun stopped
    rank, code = _RANK.search(cause), _EXIT.search(cause)
    if rank and code:
        status = int(code.group(1))
        known = status < 0 and -status in signal.Signals._value2member_map_
        how = f"killed by {signal.Signals(-status).name}" if known else f"exit {status}"
        died = f"rank {rank.group(1)} of {n} died ({how})"
    else:
        last = [line for line in stderr.splitlines() if line.strip()]
        died = f"torchrun failed ({last[-1].strip()[:200] if last else 'no message'})"
    return (
        f"`python -m pipeline {what}` on {n} ranks: {died}; nothing was written (rank 0 writes only at the end): "
        f"rerun it to resume from the last saved step"
    )
