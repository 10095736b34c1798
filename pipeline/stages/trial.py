"""Stage trial@DTYPE: the same reference under autocast, for inference and for training."""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict
from typing import Iterator

from pipeline import checkpoint, devices, paths, precision, reference, task, training
from pipeline.artifacts import read_tensors, write_json, write_tensors
from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.precision import Policy


def main(dtype: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    if dtype not in params.trial.dtypes:
        raise UserError(f"--dtype {dtype} is not in trial.dtypes {params.trial.dtypes}; add it there or pick one of them")
    device = devices.resolve(params.device)
    devices.check_dtype_supported(device, precision.parse_dtype(dtype))
    ref = reference.load(params)
    policy = Policy(dtype=dtype, fp32_modules=tuple(params.trial.fp32_modules))
    out = paths.trial(dtype)

    def initial():
        model = task.build_model(params.task, params.seed)
        checkpoint.restore(ref.checkpoint("init"), model)  # weights and RNG of the reference's start
        return model

    trained = task.build_model(params.task, params.seed)
    checkpoint.restore(ref.checkpoint(), trained, rng=False)
    train_t, _ = read_tensors(paths.PREPARED_TRAIN, ref.manifest["files"][str(paths.PREPARED_TRAIN)], "prepare")
    key = hashlib.sha256(json.dumps({"ref": ref.manifest["run_key"], "policy": policy.as_dict()}, sort_keys=True).encode()).hexdigest()
    resume = checkpoint.ResumeFile(paths.RESUME / f"trial-{dtype}.safetensors", key)
    with _missing_kernels(dtype, device):
        run = training.run_trial(
            trained, initial, train_t["x"], train_t["y"], ref.cases.x, params.reference, params.task.loss, policy, device,
            params.seed, resume=resume.load(), save_resume=resume.save, label=f"trial {dtype}",
        )
    result = run.training

    env = devices.describe(device)
    files = {
        "outputs.safetensors": write_tensors(out / "outputs.safetensors", run.outputs, {"ids": ref.cases.ids}),
        "trained_outputs.safetensors": write_tensors(out / "trained_outputs.safetensors", run.trained_outputs, {"ids": ref.cases.ids}),
        "checkpoint.safetensors": checkpoint.save(out / "checkpoint.safetensors", result.state),
    }
    write_json(out / "trajectory.json", {"steps": [asdict(r) for r in result.records], "final_scale": result.final_scale, "scaler_enabled": policy.uses_scaler})
    write_json(
        out / "manifest.json",
        {
            "files": files,
            "policy": policy.as_dict(),
            "reference_run_key": ref.manifest["run_key"],
            "rule_sha256": ref.manifest["rule_sha256"],
            "env": env,
            "env_differs_from_reference": sorted(k for k in env if env[k] != ref.manifest["env"].get(k)),
            "real_updates": result.real_updates,
        },
    )
    resume.clear()
    skipped = sum(r.skipped for r in result.records)
    print(f"trial {dtype}: {len(result.records)} steps, {result.real_updates} real updates, {skipped} skipped; final loss {result.records[-1].loss:.4f}")


@contextlib.contextmanager
def _missing_kernels(dtype: str, device) -> Iterator[None]:
    """An op without a kernel for the dtype on this device is a finding about the target, not a crash."""
    try:
        yield
    except (NotImplementedError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "not implemented for" not in first and not isinstance(exc, NotImplementedError):
            raise
        raise UserError(
            f"trial {dtype} on {device.type}: an op has no {dtype} kernel here ({first[:200]}); keep its module in FP32 "
            f"with trial.fp32_modules, or trial another dtype"
        ) from None
