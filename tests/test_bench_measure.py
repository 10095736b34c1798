"""pipeline/bench/measure.py: the record assembled from real rounds (a tiny model on the CPU, its float16
scaler forced to overflow), and what it says when no round can be compared."""

from __future__ import annotations

from pipeline.artifacts.benchmark import MemoryProbe, from_dict
from pipeline.config import Policy
from pipeline.bench.measure import record
from pipeline.bench.sizing import Sizes
from pipeline.bench.timing import interleaved
from pipeline.files import from_jsonable, to_jsonable
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
