"""Time and peak memory of training steps, strict FP32 against AMP, measured so the figures can be quoted.

The method, and why:

- Same work as the trial (``workload``): the task's model from the reference's initial weights, the trial's
  first update (same micro-batches, same batch size), the trial's optimizer, clipping and precision policy
  (FP32 modules included), stepped by the ONE update function the trial uses (``training.amp_step``,
  ``read_back=False``). The only change is what the trial adds for evidence: no loss read-back, no scale
  check, no per-step record and no learning-rate schedule (each needs a host sync), so none sits in the timed
  region. The one sync left is GradScaler's own inf check in ``scaler.step``: it is part of what FP16
  training costs.
- No skipped step is timed: the FP16 scaler starts from the trial's FINAL state (``grad_scaler`` in the trial
  checkpoint), not a fresh one at 65536 that overflows and halves through the first rounds; and every
  optimizer update is counted (a step post-hook, no sync), so a round in which the scaler still skipped an
  update (cheaper: no optimizer step) is dropped, for every variant alike, and reported.
- Sized by device (``sizing``; ``bench`` params left null): short on the CPU, where the figures only show the
  method works (the record says so); long enough on a GPU for quotable medians.
- Warm-up first (allocator, kernel selection, autocast weight cache), then rounds (``timing``): each round
  times ``steps`` steps of every variant, the order rotating from round to round, so drift (clocks,
  thermals, other load) hits all arms alike and each round gives a paired ratio.
- Clocks: on a GPU, CUDA events around the steps with a synchronize before and after; on the CPU,
  ``time.perf_counter`` (monotonic).
- Baselines (``arms``): ``fp32`` is strict FP32 (TF32 off for matmul and cuDNN), so the speedup is AMP's
  alone. Where the GPU has TF32 (NVIDIA capability 8.0+), ``tf32`` is timed beside it: it is what FP32 code
  gets there when TF32 is enabled, and AMP should be compared with it too.
- Under ``distributed.strategy: fsdp`` every arm trains a copy sharded by FSDP2, as the trials do
  (``workload.TrainingStep``): FSDP2's mixed precision runs as itself, and the record's ``method.fsdp`` says so.
- Memory (``memory``), before anything is timed. GPU: each variant in its own fresh process (``python -m
  pipeline.bench.probe``), one after the other, so one variant's cached blocks never count for the other;
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. Under FSDP2 a probe's process has no
  process group to shard in: each rank measures in its own process, one variant after the other. CPU: in the stage's own process,
  one variant after the other, each freed before the next starts (torch's CPU allocator caches nothing, and
  ``malloc_trim`` gives freed heap pages back before each round); the process's peak resident memory
  (VmHWM), reset through ``/proc/self/clear_refs`` before each round. A fresh process per variant would cost
  a torch start-up each, for the same figures.
- Figures (``stats``): median and interquartile range over rounds (nearest-rank quantiles); speedup
  (fp32 / amp time) and memory ratio (amp / fp32 peak) from per-round pairs, with their own median and IQR.
  ``measure`` runs it all and assembles the record that ``pipeline.artifacts.benchmark`` owns.
"""
