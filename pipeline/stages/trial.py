"""Stage trial@NAME: the same reference under autocast, for inference and for training, and how much of its work
ran in reduced precision (the "AMP engaged" audit). A policy under which the model raises (an op that overflows or
has no kernel for the dtype) gives a failed trial naming the op and the module, which decide rolls back."""

from __future__ import annotations

from pipeline import checkpoint, devices, distributed, launch, paths, precision, sysmetrics, task, training, transforms

from pipeline.artifacts import reference_tensors, trial, trial_tensors
from pipeline.compare import decisions
from pipeline.diagnosis import audit, failure
from pipeline.config import load_params


def main(variant: str, params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    policy = params.trial.policy(variant)
    if launch.relaunched("trial", params, params_path, variant):
        return  # it ran on distributed.nproc_per_node ranks under torchrun
    device = distributed.init(devices.resolve(params.device), params.distributed)  # one process: unchanged; else this rank's
    world = distributed.current()
    if policy.amp:
        devices.check_dtype_supported(device, precision.parse_dtype(policy.dtype))
    ref = reference_tensors.load(params)
    trained, source = ref.model(params), ref.train_data(params)
    run_key = trial.run_key(ref.manifest, policy, reference_tensors.recipe_key(params))
    resume = checkpoint.ResumeFile(paths.RESUME / f"trial-{variant}.safetensors", world.key(run_key), device)
    writer = trial_tensors.Writer(variant, ref.cases.ids, params.compare.store, params.task, ref.outputs_reader,
                                  decisions.token_kl)  # a compact trial keeps compare's KL of its full scores
    try:
        with (
            writer,
            precision.deterministic(params.reference.deterministic),
            sysmetrics.sampling(paths.system_metrics("trial", variant), devices.backend(device), world.writes),
        ):
            run = training.run_trial(
                trained, lambda: ref.model(params, "init"), source, ref.cases.x, params.reference, params.task, policy,
                device, params.seed, resume=resume.load(policy.uses_scaler), save_resume=resume.save,
                label=f"trial {variant}", sink=writer.sink if world.writes else distributed.discard,
                expect_batches=ref.batch_hashes(world.size), origin=ref.checkpoint("init"),  # reference.checkpoint's state
            )
    except Exception as exc:  # the model raised under the policy? A replay says where (failure.locate), or it goes on
        failed = failure.locate(exc, writer.part, lambda: ref.model(params), lambda: ref.model(params, "init"), source,
                                ref.cases.x, ref.cases.ids, params, policy, device, origin=ref.checkpoint("init"))
        if failed is None:
            raise
        writer.fail(failed, policy, ref.manifest, devices.describe(device).as_dict())
        resume.clear()
        print(f"trial {variant}: FAILED under its policy, a rollback for decide@{variant}\n  {failed.line(variant)}")
        return
    if not world.writes:
        return  # rank 0 alone infers and writes
    result = run.training
    applied = transforms.apply(trained, policy, device)  # what ran (its float8 layers are converted already)
    found = audit.of_trial(applied.module, source, params, policy, device) if params.reference.train_steps else \
        _inference_audit(applied.module, source, params, policy, device)  # after inference: it moves BatchNorm's buffers
    writer.finish(result, policy, ref.manifest, devices.describe(device).as_dict(), run.aligned, applied.as_dict(), found)
    resume.clear()
    skipped = sum(r.skipped for r in result.records)
    trained = (f"{len(result.records)} steps, {result.real_updates} real updates, {skipped} skipped; final loss "
               f"{result.records[-1].loss:.4f}" if result.records else "inference only (reference.train_steps 0)")
    print(f"trial {variant}: {trained}\n  audit: {found.line}")


def _inference_audit(module, source, params, policy, device):
    """An inference-only trial's audit (``reference.train_steps`` 0): the forward pass alone, no loss, on the first
    micro-batch of the training order, in the frozen train/eval mode (a training pass would say what never runs)."""
    x, _ = source.batch(training.batch_order(len(source), params.reference.batch_size, 1, params.seed)[0])
    model = module.to(device).train(not params.reference.eval_mode)
    return audit.audit(model, task.to_device(x, device), None, None, policy, device)
