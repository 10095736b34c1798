"""Diagnosis of a trial (stage diagnose@DTYPE): what went wrong first, where, and which FP32 regions fix it.

Cheap when all is well: ``triage`` reads the comparison statistics and the training record (no torch),
and nothing is replayed unless the trial fails the rule (the optional probe costs one batch). When it
fails, ``flow.run`` does, in order:

1. Locate (``replay``): replay the exact failing case (the failing fixed-set inputs with the trained
   reference weights; or the training step, rebuilt from ``data/reference/init.safetensors`` by replaying
   the steps before it, which is exact on CPU) with module and gradient hooks and an op recorder
   (``precision_map``), and name the first producer of a non-finite value: input, module output, loss or
   gradient. The same case is replayed in FP32.
2. Fix locally (``search``): put the culprit module outside autocast (``Policy.fp32_modules``) and replay
   again, until the case is finite; then re-run the whole trial under that policy and apply the rule.
3. Tolerance failures (``search``): rank the modules that run reduced-precision matmuls by what each one
   alone does to the outputs, and bisect over how many of them to keep in FP32, within
   ``diagnose.search_budget`` trial re-runs.

``wording`` turns all of it into the lines a reviewer reads. The result is a suggestion
(the variant's ``fp32_modules``), written beside the report and never applied. Every computing path starts with
``precision.strict_fp32()``: the FP32 side of a comparison is never TF32.

This file imports nothing, so ``pipeline.diagnosis.triage`` stays torch-free.
"""
