"""Stage freeze: train the FP32 reference (and its noise replicate), build boundary cases, record its outputs, and
forecast FP16's headroom from it before any trial."""

from __future__ import annotations

import dataclasses

from pipeline import cases, checkpoint, devices, distributed, forecast, inference, launch, paths, precision, probe, task, training
from pipeline import vetting

from pipeline.artifacts import reference_tensors
from pipeline.config import Policy, compiled_variants, load_params
from pipeline.files import sha256_file
from pipeline.phases import Phases

FP32 = Policy()


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    if launch.relaunched("freeze", params, params_path):
        return  # it ran on distributed.nproc_per_node ranks under torchrun
    cfg = params.reference
    device = distributed.init(devices.resolve(params.device), params.distributed)  # one process: unchanged; else this rank's
    inputs = {str(p): sha256_file(p) for p in (paths.PREPARED_CASES, paths.PREPARED_TRAIN)}
    source = task.load_train(params.task, paths.PREPARED_TRAIN, inputs[str(paths.PREPARED_TRAIN)])
    init, start = checkpoint.start(cfg.checkpoint, model := task.build_model(params.task, params.seed))  # reference.checkpoint
    inputs.update(start)  # the user's checkpoint's sha256: part of the reference's key and of its manifest
    run_key, phases = reference_tensors.run_key(params, inputs, init), Phases()
    resume = checkpoint.ResumeFile(paths.RESUME / "reference.safetensors", distributed.current().key(run_key), device)
    with precision.deterministic(cfg.deterministic):  # the probe, training and inference alike
        shifted = probe.check(model, source, params.task, device, cfg.eval_mode, compiled_variants(params),
                              cases.load(paths.PREPARED_CASES).x)  # its first batch; the rest is not held in training
        probe.check_training(model, init, source, cfg, params.task, device, params.seed)  # its first updates, twice
        checkpoint.restore(init, model)  # (the probe must not move the RNG; shifted: its loss reads the next token's label)
        with phases("reference training"):
            result = training.train(model, source, cfg, params.task, FP32, device, params.seed, resume=resume.load(),
                                    save_resume=resume.save, label="freeze FP32", origin=init)
        with phases("replicate training"):
            replicates = training.noise_replicates(params, init, source, device, run_key)
        if not distributed.current().writes:
            return  # rank 0 alone infers and writes
        with phases("boundary cases"):
            fixed = inference.with_boundary_cases(params, cases.aligned(cases.load(paths.PREPARED_CASES), shifted), model, device)
        with phases("fp64 arbiter"):  # its probe: does the model run in float64?
            fp64 = inference.fp64_chunks(model, fixed.x, cfg.eval_mode, cfg.fp64_arbiter, device=device)
        with phases("forecast"):
            headroom = forecast.of_reference(params, init, result.state, source, device)
        with phases("writing"), resume.clear_on(reference_tensors.NonFinite):  # nothing of a refused reference is kept
            manifest = reference_tensors.write(
                params=params, inputs=inputs, run_key=run_key, env=devices.describe(device).as_dict(), init=init,
                trained=result.state, records=result.records, real_updates=result.real_updates, fixed=fixed,
                outputs=phases.stream("inference", inference.infer_chunks(model, fixed.x, FP32, device, cfg.eval_mode)),
                fp64=fp64 and dataclasses.replace(fp64, chunks=phases.stream("fp64 arbiter", fp64.chunks)),
                replicates=[r.records for r in replicates], policy=FP32.as_dict(), forecast=headroom,
                scan=vetting.Scan(params, fixed), replicate_outputs=(phases.stream(
                    "replicate inference", inference.infer_chunks(r.model(params), fixed.x, FP32, device, cfg.eval_mode))
                    for r in replicates),  # one replicate's model at a time
            )
    resume.clear()
    noise = "".join(f"; FP32 replicate {k + 1} final loss {r.records[-1].loss:.4f}" for k, r in enumerate(replicates))
    noise += "; next-token targets" * shifted
    trained = f"trained {len(result.records)} steps, final loss {result.records[-1].loss:.4f}" if result.records else \
        "not trained (reference.train_steps 0: inference only)"
    print(f"freeze: reference {trained}{noise}; "
          f"{manifest.cases['total']} cases; FP64 arbiter on {fp64.cases if fp64 else 'none'} of them\n  {phases.line()}")
    roles = manifest.output_roles()
    if roles is not None:  # the role table: how compare will judge each output (acceptance.outputs.NAME.role states one)
        print("freeze: outputs, as every trial will be judged:\n" + "\n".join(f"  {line}" for line in roles.lines()))
