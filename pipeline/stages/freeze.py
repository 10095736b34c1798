"""Stage freeze: train the FP32 reference, build boundary cases, record its outputs; refuse non-finite ones."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict

import torch

from pipeline import cases, checkpoint, devices, paths, task, training
from pipeline.artifacts import read_tensors, sha256_file, write_json, write_tensors
from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.precision import Policy

FP32 = Policy()


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    device = devices.resolve(params.device)
    prepared = cases.load(paths.PREPARED_CASES)
    train_t, _ = read_tensors(paths.PREPARED_TRAIN, produced_by="prepare")
    inputs = {str(p): sha256_file(p) for p in (paths.PREPARED_CASES, paths.PREPARED_TRAIN)}

    model = task.build_model(params.task, params.seed)
    init = checkpoint.capture(model)
    try:
        probe = training.infer(model, train_t["x"][:2], FP32, device, eval_mode=True)
    except (RuntimeError, TypeError, ValueError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(
            f"task.model {params.task.model} fails on a batch of the prepared data of shape {tuple(train_t['x'][:2].shape)} "
            f"({first}); make the model take the data function's inputs, then `dvc repro`"
        ) from None
    task.check_outputs(probe, params.task.kind, min(2, train_t["x"].shape[0]), train_t["y"], params.task.model)
    checkpoint.restore(init, model)  # the probe must not move the RNG the training starts from
    run_key = _run_key(params, inputs)
    resume = checkpoint.ResumeFile(paths.RESUME / "reference.safetensors", run_key)
    result = training.train(
        model, train_t["x"], train_t["y"], params.reference, params.task.loss, FP32, device, params.seed,
        resume=resume.load(), save_resume=resume.save, label="freeze FP32",
    )
    ordinary_n = sum(k == "ordinary" for k in prepared.kinds)
    fixed = prepared
    if params.task.kind == "classification" and params.reference.boundary_cases:
        ordinary = cases.Cases(prepared.ids[:ordinary_n], prepared.x[:ordinary_n], prepared.y[:ordinary_n], prepared.has_target[:ordinary_n])
        def score(x: torch.Tensor) -> torch.Tensor:
            return task.primary(training.infer(model, x, FP32, device, params.reference.eval_mode))

        fixed = prepared + cases.boundary_cases(score, ordinary, params.reference.boundary_cases, params.reference.boundary_epsilon, prepared.y)
    outputs = training.infer(model, fixed.x, FP32, device, params.reference.eval_mode)
    bad = sorted({fixed.ids[i] for v in outputs.values() for i in torch.nonzero(~torch.isfinite(v.reshape(v.shape[0], -1)).all(dim=1)).flatten().tolist()})
    if bad:
        resume.clear()  # nothing of a refused reference is kept
        raise UserError(
            f"the FP32 reference is not finite on {len(bad)} case(s) ({', '.join(bad[:5])}); an incorrect FP32 run is no "
            f"baseline: fix the model, data or prepare.edge_scales, then rerun"
        )
    fp64 = _fp64_outputs(model, fixed.x, params.reference.eval_mode)

    files = dict(inputs)
    files[str(paths.REF_INIT)] = checkpoint.save(paths.REF_INIT, init)
    files[str(paths.REF_CHECKPOINT)] = checkpoint.save(paths.REF_CHECKPOINT, result.state)
    files[str(paths.REF_CASES)] = cases.save(paths.REF_CASES, fixed)
    files[str(paths.REF_OUTPUTS)] = write_tensors(paths.REF_OUTPUTS, outputs, {"ids": fixed.ids})
    if fp64 is not None:
        files[str(paths.REF_OUTPUTS_FP64)] = write_tensors(paths.REF_OUTPUTS_FP64, fp64, {"ids": fixed.ids})
    write_json(paths.REF_TRAJECTORY, {"steps": [asdict(r) for r in result.records]})
    write_json(
        paths.REF_MANIFEST,
        {
            "files": files,
            "rule_sha256": params.acceptance.sha256(),
            "run_key": run_key,
            "env": devices.describe(device),
            "policy": FP32.as_dict(),
            "real_updates": result.real_updates,
            "cases": {"total": len(fixed.ids), **{k: fixed.kinds.count(k) for k in sorted(set(fixed.kinds))}},
        },
    )
    resume.clear()
    print(f"freeze: reference trained {len(result.records)} steps, final loss {result.records[-1].loss:.4f}; {len(fixed.ids)} cases")


def _run_key(params, inputs: dict[str, str]) -> str:
    blob = json.dumps({"seed": params.seed, "task": asdict(params.task), "reference": asdict(params.reference), "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _fp64_outputs(model: torch.nn.Module, x: torch.Tensor, eval_mode: bool) -> dict[str, torch.Tensor] | None:
    """The FP64 arbiter on CPU, where the model allows it (None otherwise)."""
    try:
        arbiter = copy.deepcopy(model).to("cpu").double()
        arbiter.train(not eval_mode)
        with torch.no_grad():
            return {k: v.double().contiguous() for k, v in task.named_outputs(arbiter(x.double())).items()}
    except (RuntimeError, TypeError, NotImplementedError):
        return None
