"""The LM case at an LLM's output size (issue 23 item 4): every stage of a verdict on 1e9 scores per source, each
stage's wall time, peak RSS and bytes written under data/, then the verdict and the cost of a verdict (the necessary
trainings against the stages' time, and where the rest goes: scripts/timings.py's figures).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/lm_scale.py [--size lm-1e9] [--sequences N] [--workdir DIR] [--keep]
                                                           [--max-rss-gib 24] [--threads N]

The project is copied (scripts/_project.py) with examples/lm.params.yaml and examples/sizes/SIZE.yaml merged in
(--sequences overrides its eval sequences: 128 is a quarter of lm-1e9's), and the stages of one variant's verdict
(prepare, freeze, trial@NAME, compare@NAME, diagnose@NAME, decide@NAME: decide reads diagnose's file) run as
dvc.yaml gives them but without dvc: DVC's cache would hold a second copy of every output, and the disk is the
limit here. Before anything runs, the free disk under the work folder is checked against what the outputs need
(the compact store: 2 bytes a score, each source; the FP64 arbiter's float64 cases besides).

Each stage runs as its own process; its peak RSS is the kernel's (``os.wait4``'s ``ru_maxrss``). A watchdog
reads the stage's resident memory every half second and stops it above --max-rss-gib, or when the machine's
available memory falls under half a GiB (the machine is shared: a stage out of memory would otherwise take a
neighbour down with it), naming the stage. The figures are printed, never asserted: a timed test on a shared
machine would measure the neighbours. The work folder is deleted at the end unless --keep.
"""

# No `from __future__ import annotations`: the dataclass must build in a module loaded from its file (the test does).
import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import _project
import timings

STAGES = ("prepare", "freeze", "trial", "compare", "diagnose", "decide")
"""The stages of one variant's verdict, by dvc.yaml's names (benchmark, publish and report are not part of it)."""
TOKEN_PART_BYTES = 32
"""The compact store's bytes per token besides its codes: top, step, second (float32), second_index (int32), and the
row's log-sum-exp and live spread (float64)."""
KL_BYTES = 8
"""A compact trial's ``outputs`` also keep each token's KL against the reference (float64)."""
FP64_AUTO_ELEMENTS = 16_000_000
"""inference.FP64_AUTO_ELEMENTS (not imported: that module imports torch, this script never does)."""
SLACK = 1.05
GIB = 2**30


@dataclass(frozen=True)
class Measured:
    """One stage's process: wall seconds, peak RSS (bytes), bytes its run added under data/, its exit status."""

    name: str
    seconds: float
    peak_rss: int
    data_bytes: int
    returncode: int
    stopped: str
    """Why the watchdog stopped it ('' when it was not)."""


def project_params(size: str, sequences: int | None, threads: int | None) -> dict:
    """The LM example's params at ``size``, with ``sequences`` eval sequences when given."""
    values = _project.merge(_project.example("lm"), _project.size(size))
    if sequences is not None:
        values = _project.merge(values, {"task": {"options": {"n_eval": sequences}}, "prepare": {"ordinary_cases": sequences}})
    return _project.merge(values, {"threads": threads}) if threads is not None else values


def scores_per_source(values: dict) -> tuple[int, int]:
    """(cases, scores per source) the fixed set will hold: ordinary and boundary cases (token ids have no edge cases)."""
    options = values["task"]["options"]
    cases = min(values["prepare"]["ordinary_cases"], options["n_eval"]) + values["reference"]["boundary_cases"]
    return cases, cases * options["seq_len"] * options["vocab"]


def needed_bytes(values: dict) -> int:
    """Disk the outputs need: the reference's scores (always full) and each variant's two (before and after its
    training) in the store, the FP64 arbiter's float64 scores at its auto size, and 5% for everything else."""
    cases, scores = scores_per_source(values)
    tokens = cases * values["task"]["options"]["seq_len"]
    variants = len(values["trial"]["variants"])
    if values["compare"]["store"] != "full":
        per_variant = 2 * (2 * scores + TOKEN_PART_BYTES * tokens) + KL_BYTES * tokens
    else:
        per_variant = 2 * 4 * scores
    return int(SLACK * (4 * scores + variants * per_variant + 8 * min(scores, FP64_AUTO_ELEMENTS)))


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` now (VmRSS), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_stage(stage: _project.Stage, repo: Path, log: Path, max_rss: int) -> Measured:
    """Run ``stage`` in ``repo`` (output to ``log``) under the watchdog; return what it measured."""
    before = tree_bytes(repo / "data")
    stopped: list[str] = []
    t0 = time.perf_counter()
    with log.open("w") as out:
        env = dict(_project.env_for(repo), PYTHONPROFILEIMPORTTIME="1")  # its imports' times, for the cost of a verdict
        proc = subprocess.Popen(stage.argv(), cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.5):
                rss, free = rss_bytes(proc.pid), available_bytes()
                if rss > max_rss or free < GIB // 2:
                    stopped.append(f"resident {rss / GIB:.1f} GiB, machine's available memory {free / GIB:.1f} GiB")
                    os.kill(proc.pid, signal.SIGKILL)
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: its pid is not reused yet
        done.set()
        watcher.join()  # the watchdog has stopped before the pid is freed
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    seconds = time.perf_counter() - t0
    return Measured(stage.name, seconds, usage.ru_maxrss * 1024, tree_bytes(repo / "data") - before, proc.returncode,
                    stopped[0] if stopped else "")


def header(path: Path) -> dict:
    """A safetensors file's JSON header (names, dtypes, shapes, metadata), read without torch."""
    with path.open("rb") as handle:
        return json.loads(handle.read(int.from_bytes(handle.read(8), "little")))


def store_figures(path: Path) -> tuple[int, int, int]:
    """(scores, bytes on disk, bytes the full float32 store would take) of an outputs file."""
    head = header(path)
    meta = head.pop("__metadata__", {})
    squeezed = json.loads(meta.get("compact", "[]"))
    scores, full = 0, path.stat().st_size
    for name, entry in head.items():
        count = 1
        for d in entry["shape"]:
            count *= d
        output, _, part = name.partition("::")
        if output in squeezed:
            full -= entry["data_offsets"][1] - entry["data_offsets"][0]
            if part == "codes":
                scores += count
                full += 4 * count
        else:
            scores += count
    return scores, path.stat().st_size, full


def report_outputs(repo: Path, variant: str) -> None:
    files = [repo / "data/reference/outputs.safetensors", repo / f"data/trial/{variant}/outputs.safetensors",
             repo / f"data/trial/{variant}/trained_outputs.safetensors"]
    total, total_full = 0, 0
    for path in files:
        if path.exists():
            scores, size, full = store_figures(path)
            total, total_full = total + size, total_full + full
            print(f"  {path.relative_to(repo)}: {scores:.4g} scores, {size / GIB:.2f} GiB on disk "
                  f"(the full float32 store: {full / GIB:.2f} GiB)")
    fp64 = repo / "data/reference/outputs_fp64.safetensors"
    if fp64.exists():
        print(f"  {fp64.relative_to(repo)}: {store_figures(fp64)[0]:.4g} float64 scores, {fp64.stat().st_size / GIB:.2f} GiB")
    print(f"  the {len(files)} sources: {total / GIB:.2f} GiB compact, {total_full / GIB:.2f} GiB in the full store")


def report_verdict(repo: Path, variant: str) -> None:
    decision = repo / f"data/decision/{variant}/decision.json"
    stats = repo / f"data/compare/{variant}/stats.json"
    if stats.exists():
        dist = json.loads(stats.read_text()).get("distribution") or {}
        keys = ("store", "tokens", "kl_mean", "kl_mean_se", "kl_bound", "top1_agreement", "logit_error")
        print("  compare: " + ", ".join(f"{k} {dist[k]:.4g}" if isinstance(dist.get(k), float) else f"{k} {dist.get(k)}"
                                         for k in keys if k in dist))
    if decision.exists():
        found = json.loads(decision.read_text())
        print(f"  verdict: {found['decision']}" + "".join(f"\n    - {r}" for r in found["reasons"][:6]))


def tail(log: Path, lines: int = 4) -> str:
    text = [line for line in log.read_text(errors="replace").rstrip().splitlines() if not line.startswith("import time:")]
    return "\n".join(f"    | {line[:200]}" for line in text[-lines:])


def print_cost(repo: Path, measured: list[Measured]) -> None:
    """The cost of a verdict (timings.py's, from the stages' logs): the necessary trainings against the stages' time.
    No DVC runs here, so its dvc.lock rewrites and output hashing are not in it."""
    raw = {m.name: (repo / "logs" / f"{m.name}.log").read_text(errors="replace").splitlines() for m in measured}
    run = timings.of_stages(sum(m.seconds for m in measured), {m.name: m.seconds for m in measured}, raw)
    timings.print_cost(timings.cost_of_verdict(run, rewrite_s=0.0), what="the stages, one after the other,")
    print("  (the stages run without DVC here: its dvc.lock rewrites and its hashing of the outputs are not counted)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="lm-1e9", help="examples/sizes/NAME.yaml merged into the LM example")
    parser.add_argument("--sequences", type=int, help="eval sequences of the fixed set (default: the size's)")
    parser.add_argument("--threads", type=int, help="params threads of every stage (default: the example's)")
    parser.add_argument("--workdir", type=Path, help="make the project here (default: a new folder under the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (default: deleted at the end)")
    parser.add_argument("--max-rss-gib", type=float, default=24.0, help="stop a stage whose resident memory exceeds this")
    args = parser.parse_args()
    values = project_params(args.size, args.sequences, args.threads)
    variant = values["trial"]["variants"][0]
    values = _project.merge(values, {"trial": {"variants": [variant]}})
    parent = args.workdir.parent if args.workdir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    need, free = needed_bytes(values), shutil.disk_usage(parent).free
    if free < need:
        raise SystemExit(f"lm_scale: {free / GIB:.1f} GiB free under {parent}, the run needs {need / GIB:.1f} GiB; "
                         f"free some or pass --sequences (fewer) or --workdir on a larger disk")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lm-scale-"))
    cases, scores = scores_per_source(values)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {available_bytes() / GIB:.1f} GiB available of memory, "
          f"{free / GIB:.1f} GiB free disk under {parent} (the run needs {need / GIB:.1f} GiB); params threads "
          f"{values['threads']}, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')}")
    opts = values["task"]["options"]
    print(f"LM {args.size}: {cases} cases x {opts['seq_len']} tokens x {opts['vocab']} vocabulary = {scores:.4g} scores per "
          f"source; d_model {opts['d_model']}, {opts['layers']} layer(s), {values['reference']['train_steps']} updates; "
          f"variant {variant}; compare.store {values['compare']['store']}; work folder {work}")
    try:
        _project.copy(work, base=values)
        (work / "logs").mkdir(exist_ok=True)
        stages = [s for s in _project.plan(values, work) if s.name.split("@")[0] in STAGES]
        started, measured = time.perf_counter(), []
        print(f"{'stage':<20} {'wall s':>8} {'peak RSS GiB':>13} {'data/ GiB':>10}")
        for stage in stages:
            m = run_stage(stage, work, work / "logs" / f"{stage.name}.log", int(args.max_rss_gib * GIB))
            measured.append(m)
            print(f"{m.name:<20} {m.seconds:8.1f} {m.peak_rss / GIB:13.2f} {m.data_bytes / GIB:10.2f}")
            print(tail(work / "logs" / f"{stage.name}.log"))
            if m.returncode != 0:
                why = f"stopped by the watchdog ({m.stopped})" if m.stopped else f"exited {m.returncode}"
                raise SystemExit(f"lm_scale: {m.name} {why}; its log: {work / 'logs' / (m.name + '.log')}"
                                 + ("" if args.keep else " (deleted with the work folder: rerun with --keep)"))
        print(f"all stages: {time.perf_counter() - started:.1f} s; data/ holds {tree_bytes(work / 'data') / GIB:.2f} GiB")
        report_outputs(work, variant)
        report_verdict(work, variant)
        print_cost(work, measured)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
