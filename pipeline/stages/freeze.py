"""Stage freeze: train the FP32 reference (and its noise replicate), build boundary cases, record its outputs, and
forecast FP16's headroom from it before any trial."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from dataclasses import asdict
from typing import Iterable, Iterator

import torch

from pipeline import cases, checkpoint, devices, distributed, forecast, inference, launch, paths, precision, probe, task, training
from pipeline import vetting

from pipeline.artifacts import reference_tensors
from pipeline.files import sha256_file
from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.config import Policy

FP32 = Policy()


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    if launch.relaunched("freeze", params, params_path):
        return  # it ran on distributed.nproc_per_node ranks under torchrun
    cfg = params.reference
    device = distributed.init(devices.resolve(params.device))  # one process: unchanged; under torchrun: this rank's
    world = distributed.current()
    prepared = cases.load(paths.PREPARED_CASES)
    inputs = {str(p): sha256_file(p) for p in (paths.PREPARED_CASES, paths.PREPARED_TRAIN)}
    source = task.load_train(params.task, paths.PREPARED_TRAIN, inputs[str(paths.PREPARED_TRAIN)])
    model = task.build_model(params.task, params.seed)
    init = checkpoint.capture(model)
    probe.check(model, source, params.task, device)
    checkpoint.restore(init, model)  # the probe must not move the RNG the training starts from
    run_key = _run_key(params, inputs, init)
    phases = Phases()
    resume = checkpoint.ResumeFile(paths.RESUME / "reference.safetensors", world.key(run_key), device)
    with precision.deterministic(cfg.deterministic):  # training and inference alike
        with phases("reference training"):
            result = training.train(
                model, source, cfg, params.task, FP32, device, params.seed, resume=resume.load(), save_resume=resume.save,
                label="freeze FP32",
            )
        with phases("replicate training"):
            replicate = _replicate(params, init, source, device, run_key) if cfg.noise_replicate else None
        if not world.writes:
            return  # rank 0 alone infers and writes
        with phases("boundary cases"):
            fixed = _with_boundary(params, prepared, model, device)
        with phases("fp64 arbiter"):  # its probe: does the model run in float64?
            fp64 = inference.fp64_chunks(model, fixed.x, cfg.eval_mode, cfg.fp64_arbiter)
        with phases("forecast"):
            headroom = forecast.of_reference(params, init, result.state, source, device)
        try:
            with phases("writing"):
                manifest = reference_tensors.write(
                    params=params, inputs=inputs, run_key=run_key, env=devices.describe(device).as_dict(), init=init,
                    trained=result.state, records=result.records, real_updates=result.real_updates, fixed=fixed,
                    outputs=phases.stream("inference", inference.infer_chunks(model, fixed.x, FP32, device, cfg.eval_mode)),
                    fp64=fp64 and dataclasses.replace(fp64, chunks=phases.stream("fp64 arbiter", fp64.chunks)),
                    replicate=replicate, policy=FP32.as_dict(), forecast=headroom, scan=vetting.Scan(params, fixed),
                    store=params.compare.store,
                )
        except reference_tensors.NonFinite as bad:
            resume.clear()  # nothing of a refused reference is kept
            raise UserError(
                f"the FP32 reference is not finite on {len(bad.args[0])} case(s) ({', '.join(bad.args[0][:5])}); "
                f"an incorrect FP32 run is no baseline: fix the model, data or prepare.edge_scales, then rerun"
            ) from None
    resume.clear()
    noise = f"; FP32 replicate final loss {replicate[-1].loss:.4f}" if replicate else ""
    print(
        f"freeze: reference trained {len(result.records)} steps, final loss {result.records[-1].loss:.4f}{noise}; "
        f"{manifest.cases['total']} cases; FP64 arbiter on {fp64.cases if fp64 else 'none'} of them\n  {phases.line()}"
    )


class Phases:
    """Wall seconds per phase of freeze, printed on its last line for scripts/timings.py (the cost of a verdict):
    stdout only, never a DVC output, since timings differ run to run. What ``stream`` times inside the write
    counts under its own name, not under ``writing``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.streamed = 0.0

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def stream(self, name: str, chunks: Iterable[dict]) -> Iterator[dict]:
        """``chunks`` passed on, the time spent producing each counted as ``name``."""
        it = iter(chunks)
        while True:
            t0 = time.perf_counter()
            with self(name):
                chunk = next(it, None)
            self.streamed += time.perf_counter() - t0
            if chunk is None:
                return
            yield chunk

    def line(self) -> str:
        own = dict(self.seconds, writing=self.seconds.get("writing", 0.0) - self.streamed)
        return "freeze seconds: " + ", ".join(f"{name} {s:.2f}" for name, s in own.items())


def _with_boundary(params, prepared: cases.Cases, model, device) -> cases.Cases:
    """The prepared cases plus boundary cases from the trained reference (classification only)."""
    cfg = params.reference
    if params.task.kind != "classification" or not cfg.boundary_cases:
        return prepared
    ordinary = prepared.select(torch.tensor([i for i, k in enumerate(prepared.kinds) if k == "ordinary"]))

    def score(x):
        return task.primary(inference.infer(model, x, FP32, device, cfg.eval_mode))

    return prepared + cases.boundary_cases(
        score, ordinary, cfg.boundary_cases, cfg.boundary_epsilon, prepared.y, method=cfg.boundary_method
    )


def _replicate(params, init, source, device, run_key) -> list:
    """The FP32 noise replicate: the reference's start (weights and RNG), another data order (``training.neighbours_swapped``)."""
    model = task.build_model(params.task, params.seed)
    checkpoint.restore(init, model)
    order = training.neighbours_swapped(training.update_batches(len(source), params.reference, params.seed))
    resume = checkpoint.ResumeFile(paths.RESUME / "replicate.safetensors", distributed.current().key(run_key), device)
    result = training.train(
        model, source, params.reference, params.task, FP32, device, params.seed, resume=resume.load(), save_resume=resume.save,
        label="freeze FP32 replicate", batches=order,
    )
    if distributed.current().writes:
        resume.clear()
    return result.records


def _run_key(params, inputs: dict[str, str], init) -> str:
    """The reference's identity: params, prepared inputs, the initial weights (a pretrained directory's too)
    and the source of the task's own modules. The resume state adds the pipeline's code, the thread counts
    and the world size (``checkpoint.ResumeFile``)."""
    code = task.source_digest(task.entry_points(params.task, params.reference.optimizer))
    blob = json.dumps({"seed": params.seed, "task": asdict(params.task), "reference": _trained_by(params.reference),
                       "inputs": inputs, "init": checkpoint.tensors_digest(init.tensors), "code": code}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _trained_by(cfg) -> dict:
    """The reference params that shape its training and fixed set, for its run key: the FP64 arbiter's size
    changes neither, so resizing it keeps the trials' resume states."""
    return {k: v for k, v in asdict(cfg).items() if k != "fp64_arbiter"}
