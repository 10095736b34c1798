"""pipeline/bench/measure.py: the record assembled from real rounds (a tiny model on the CPU, its float16
scaler forced to overflow), what it says when no round can be compared, and the speed verdict of a model that
AMP cannot speed up (no matmul), judged against FP32 timed again in the same rounds."""

from __future__ import annotations

import copy

import torch

from pipeline import devices
from pipeline.artifacts.benchmark import FASTER, FP32_AGAIN, NO_DIFFERENCE, SLOWER, MemoryProbe, from_dict
from pipeline.bench.arms import arms, timed_arms
from pipeline.bench.measure import fsdp_words, record
from pipeline.bench.sizing import Sizes
from pipeline.bench.stats import speed_verdict
from pipeline.bench.timing import interleaved
from pipeline.bench.workload import InferenceStep, TrainingStep, Workload, forward_param_dtypes
from pipeline.config import Params, Policy
from pipeline.distributed import World
from pipeline.files import from_jsonable, to_jsonable
from pipeline.present import verdict
from test_bench_timing import CPU, overflowing

FP16, BF16 = Policy(dtype="float16"), Policy(dtype="bfloat16")

ENV = {"backend": "cpu", "device": "cpu", "device_name": "Some CPU", "capability": "AVX2", "torch": "2.13.0"}


def probes(skipped: dict[str, list[int]], peak: float = 2.0) -> dict[str, MemoryProbe]:
    return {n: MemoryProbe((peak,) * len(s), (1.0,) * len(s), tuple(s), "m") for n, s in skipped.items()}


def test_the_record_keeps_dropped_rounds_out_of_every_ratio() -> None:
    fp32, amp = overflowing(2.0**22)
    rounds = interleaved({"fp32": (fp32, False), "amp": (amp, False)}, warmup=0, repeats=6, steps=2, device=CPU)
    result = record("float16", FP16, ENV, amp.work, Sizes(0, 6, 2, "test"), "n/a", probes(rounds.skipped), rounds, 0.5)
    assert result.rounds_dropped.timed == (0, 1) and result.rounds_dropped.skipped_updates == {"amp": (2, 1, 0, 0, 0, 0)}
    assert result.speedup.n == 4 and result.seconds_per_step["amp"].n == 4 and result.speedup_vs_tf32 is None
    assert len(result.samples.seconds_per_step["amp"]) == 6, "the samples keep every round"
    assert result.memory.memory_rounds_dropped == {"amp": (0, 1)} and result.memory.memory_ratio.n == 4
    assert result.workload.initial_grad_scaler["scale"] == 2.0**22 and result.workload.parameters == 8 * 16 + 16 + 16 * 4 + 4
    assert result.method.memory == "m; in this process, one arm after the other" and result.method.cpu_load_1min == 0.5
    assert result.method.fsdp is None and "fsdp" not in result.as_dict()["method"]  # no FSDP2: the record as it was
    assert "2 round(s) dropped" in result.summary_line() and "[CPU" in result.summary_line()
    # What the file holds reads back to the same record.
    assert from_dict(from_jsonable(to_jsonable(result.as_dict()))) == result


def test_every_round_skipped_gives_no_speedup_and_says_why() -> None:
    fp32, amp = overflowing(2.0**60)
    rounds = interleaved({"fp32": (fp32, False), "amp": (amp, False)}, warmup=0, repeats=3, steps=2, device=CPU)
    assert rounds.dropped() == [0, 1, 2]
    result = record(
        "float16", FP16, ENV, amp.work, Sizes(0, 3, 2, "test"), "n/a", probes({"fp32": [0] * 3, "amp": [0] * 3}), rounds, None
    )
    assert result.speedup is None and result.seconds_per_step is None and "raise bench.warmup" in result.no_speedup_because
    written = result.as_dict()
    assert "speedup" not in written and "seconds_per_step" not in written, "no key at all: readers that find one can trust it"
    assert result.metrics() == {"speedup": None, "mem_ratio": 1.0}
    assert "raise bench.warmup" in result.summary_line()


def test_bfloat16_records_that_it_runs_no_scaler() -> None:
    _, amp = overflowing(1.0)
    rounds = interleaved({"fp32": (amp, False), "amp": (amp, False)}, warmup=0, repeats=1, steps=1, device=CPU)
    memory = probes({"fp32": [0], "amp": [0]})
    result = record("bfloat16", BF16, ENV, amp.work, Sizes(0, 1, 1, "test"), "n/a", memory, rounds, None)
    assert result.workload.initial_grad_scaler == "none: only float16 uses a GradScaler"


def test_the_record_says_which_dtype_the_forward_read_the_parameters_in() -> None:
    """``method.fsdp``'s dtype is seen, not configured: autocast leaves the parameters FP32 (it casts op by op); FSDP2's
    mixed precision casts them (here one process's inference-only step, ``precision.param_cast``; the ranks' sharded
    copies in tests/test_e2e_fsdp.py)."""
    _, amp = overflowing(1.0)
    assert forward_param_dtypes(amp) == ("float32",)
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)), torch.randn(2, 8)
    cast = InferenceStep(Workload(model, [(x, torch.zeros(2))], Params(), CPU, {}), Policy(fsdp_param_dtype="bfloat16"))
    assert forward_param_dtypes(cast) == ("bfloat16",)
    words = fsdp_words(World(size=2, backend="gloo", strategy="fsdp", blocks=("Block",)), ("bfloat16",))
    assert words.startswith("FSDP2 (fully_shard) on 2 ranks (gloo)") and "(blocks: Block; then the root)" in words
    assert words.endswith("the amp arm's parameters in its forward: bfloat16")
    inferring = fsdp_words(World(size=2, backend="gloo", strategy="fsdp"), ("bfloat16",), trains=False)
    assert inferring.startswith("FSDP2 on 2 ranks (gloo) shards training only") and "sharded copy" not in inferring
    _, amp = overflowing(1.0)
    rounds = interleaved({"fp32": (amp, False), "amp": (amp, False)}, warmup=0, repeats=1, steps=1, device=CPU)
    sharded = record("float16", FP16, ENV, amp.work, Sizes(0, 1, 1, "t"), "n/a", probes(rounds.skipped), rounds, None, words)
    assert from_dict(from_jsonable(to_jsonable(sharded.as_dict()))).method.fsdp == words


class Elementwise(torch.nn.Module):
    """No matmul, convolution or attention: a per-feature scale and shift, nothing autocast could run in bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.shift = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale + self.shift)


def test_a_model_without_matmuls_is_not_called_faster_by_a_margin_within_the_noise() -> None:
    """The real arms, steps, rounds and record on the CPU. What is checked is the logic, never a speed: the
    verdict is the one function's over the recorded intervals, and any verdict other than "no measurable
    difference" has its whole interval outside 1 and outside FP32 against itself."""
    torch.manual_seed(0)
    model, x, y = Elementwise(), torch.randn(64, 4), torch.randint(0, 4, (64,))
    policy = Policy(dtype="bfloat16")
    chosen, note = arms(policy, devices.describe(CPU))
    steps = {
        a.name: (TrainingStep(Workload(copy.deepcopy(model), [(x, y)], Params(), CPU, {}), a.policy), a.tf32)
        for a in timed_arms(chosen)
    }
    assert list(steps) == ["fp32", "amp", "fp32_again"]
    rounds = interleaved(steps, warmup=1, repeats=9, steps=3, device=CPU)
    memory = probes({"fp32": [0] * 9, "amp": [0] * 9})
    result = record("bfloat16", policy, ENV, steps["amp"][0].work, Sizes(1, 9, 3, "test"), note, memory, rounds, None)
    s = result.speed
    assert len(result.samples.seconds_per_step[FP32_AGAIN]) == 9 and result.seconds_per_step[FP32_AGAIN].n == 9
    assert s.speedup.median == result.speedup.median and s.speedup.n == s.fp32_again.n == 9
    for i in (s.speedup, s.fp32_again):  # nine rounds: the 2nd and 8th ratios, at 96.1 %
        assert i.low <= i.median <= i.high and i.coverage >= i.level == 0.95 and i.high < float("inf")
    assert s.verdict == speed_verdict(s.speedup, s.fp32_again)
    if s.verdict == FASTER:
        assert s.speedup.low > max(1.0, s.fp32_again.high)
    elif s.verdict == SLOWER:  # autocast's own overhead on steps this small can be a real, measured slowdown
        assert s.speedup.high < min(1.0, s.fp32_again.low)
    else:
        assert s.verdict == NO_DIFFERENCE
    # Every word of it follows the verdict: the stage's line and the report's say the same, with the interval.
    words = s.words()
    assert words in result.summary_line() and "95 % interval" in words and "FP32 against itself" in words
    assert verdict.speed_words(from_jsonable(to_jsonable(result.as_dict()))) == words
    assert from_dict(from_jsonable(to_jsonable(result.as_dict()))) == result
