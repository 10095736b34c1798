"""GPU system metrics: nothing on the CPU, a side file of timed samples on a GPU, logged by publish into a real MLflow
run's system metrics. The GPU is a backend of this file's where none is visible (``ScriptedGpu``: the interface that
the real monitors implement, ``sysmetrics.Backend``); the test marked ``gpu`` runs the real one."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from conftest import blank_mlflow_db

from pipeline import sysmetrics, tracking
from pipeline.errors import UserError

UTIL = "system/gpu_0_utilization_percentage"
MEMORY = "system/gpu_0_memory_usage_megabytes"


class ScriptedGpu:
    """One GPU whose utilisation climbs by 10 at each reading, and whose monitor breaks after ``fail_after`` of them."""

    name = "scripted"

    def __init__(self, fail_after: int | None = None) -> None:
        self.reads, self.closed, self.fail_after = 0, False, fail_after

    def read(self) -> dict[str, float]:
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise RuntimeError("driver went away")
        self.reads += 1
        return {"gpu_0_utilization_percentage": 10.0 * self.reads, "gpu_0_memory_usage_megabytes": 512.0}

    def close(self) -> None:
        self.closed = True


def test_a_cpu_run_samples_nothing_writes_nothing_and_removes_a_stale_file(tmp_path: Path) -> None:
    path = tmp_path / "system-metrics" / "trial-float16.json"
    path.parent.mkdir()
    path.write_text("{}")  # what an earlier GPU run left: not this run's
    with sysmetrics.sampling(path, "cpu"):
        time.sleep(0.05)
    assert not path.exists()
    assert sysmetrics.read(path) == []


def test_a_gpu_backend_without_a_gpu_or_library_opens_no_monitor_and_fails_nothing(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here: the real monitor is the gpu test's")
    path = tmp_path / "trial-float16.json"
    for backend in ("cuda", "rocm"):
        assert sysmetrics.open_backend(backend) is None
        with sysmetrics.sampling(path, backend):
            pass
        assert not path.exists()


def test_samples_are_timed_written_atomically_and_read_back(tmp_path: Path) -> None:
    gpu, path = ScriptedGpu(), tmp_path / "trial-float16.json"
    before = int(time.time() * 1000)
    with sysmetrics.sampling(path, "cuda", backend=gpu, interval_s=0.02):
        time.sleep(0.3)
    samples = sysmetrics.read(path)
    assert len(samples) >= 4 and gpu.closed  # at start, every 20 ms, at stop
    assert [s.metrics[UTIL] for s in samples] == [10.0 * (i + 1) for i in range(len(samples))]
    assert {s.metrics[MEMORY] for s in samples} == {512.0}
    times = [s.timestamp_ms for s in samples]
    assert times == sorted(times) and before <= times[0] and times[-1] - times[0] >= 250
    assert json.loads(path.read_text())["backend"] == "scripted"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left beside it


def test_a_failed_block_or_another_rank_writes_no_samples(tmp_path: Path) -> None:
    gpu, path = ScriptedGpu(), tmp_path / "benchmark-float16.json"
    with pytest.raises(ZeroDivisionError):
        with sysmetrics.sampling(path, "cuda", backend=gpu, interval_s=0.02):
            1 / 0
    assert not path.exists() and gpu.closed and gpu.reads >= 1
    idle = ScriptedGpu()
    with sysmetrics.sampling(path, "cuda", writes=False, backend=idle):
        time.sleep(0.05)
    assert not path.exists() and idle.reads == 0


def test_a_monitor_that_breaks_midway_keeps_its_samples_and_the_stage_goes_on(tmp_path: Path, capsys) -> None:
    path = tmp_path / "trial-float16.json"
    with sysmetrics.sampling(path, "cuda", backend=ScriptedGpu(fail_after=3), interval_s=0.01):
        time.sleep(0.1)
    assert [s.metrics[UTIL] for s in sysmetrics.read(path)] == [10.0, 20.0, 30.0]
    assert "sampling stopped (scripted: driver went away)" in capsys.readouterr().err


def test_a_damaged_file_is_left_out_in_one_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "trial-float16.json"
    path.write_text('{"backend": "nvml"}')
    assert sysmetrics.read(path) == []
    assert f"{path} left out" in capsys.readouterr().err


def test_publish_logs_the_samples_as_the_childs_system_metrics(tmp_path: Path) -> None:
    """Through the Publisher into a real sqlite store: the trial's samples, then the benchmark's, as one timeline
    with steps counted across both; a missing file (a rolled-back variant's benchmark) adds nothing."""
    trial, bench = tmp_path / "trial-float16.json", tmp_path / "benchmark-float16.json"
    with sysmetrics.sampling(trial, "cuda", backend=ScriptedGpu(), interval_s=0.02):
        time.sleep(0.1)
    with sysmetrics.sampling(bench, "cuda", backend=ScriptedGpu(), interval_s=0.02):
        time.sleep(0.1)
    expected = sysmetrics.read(trial) + sysmetrics.read(bench)
    db = tmp_path / "mlflow.db"
    shutil.copy(blank_mlflow_db(), db)
    publisher = tracking.Publisher("amp-validation", f"sqlite:///{db}")
    parent = tracking.RunSpec("parent", {})
    child = tracking.RunSpec("float16", {"variant": "float16"}, system_metrics=[trial, bench, tmp_path / "absent.json"])
    done = publisher.publish("key-1", parent, [child])
    client = publisher.client
    (child_run,) = client.search_runs([done.experiment_id], f"tags.`mlflow.parentRunId` = '{done.run_id}'")
    history = sorted(client.get_metric_history(child_run.info.run_id, UTIL), key=lambda m: m.step)
    assert [(m.step, m.timestamp, m.value) for m in history] == [
        (i, s.timestamp_ms, s.metrics[UTIL]) for i, s in enumerate(expected)
    ]
    assert len(client.get_metric_history(child_run.info.run_id, MEMORY)) == len(expected)
    assert not [k for k in client.get_run(done.run_id).data.metrics if k.startswith(sysmetrics.PREFIX)]
    assert tracking.log_system_metrics(client, done.run_id, [tmp_path / "absent.json"]) == 0


@pytest.mark.gpu
def test_the_real_monitor_samples_a_busy_gpu(tmp_path: Path) -> None:
    import torch

    from pipeline import devices

    backend = devices.backend(torch.device("cuda"))
    pytest.importorskip("pyrsmi" if backend == "rocm" else "pynvml")
    path = tmp_path / "trial-float16.json"
    x = torch.randn(4096, 4096, device="cuda")
    with sysmetrics.sampling(path, backend, interval_s=0.25):
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            x = (x @ x).tanh_()
            torch.cuda.synchronize()
    samples = sysmetrics.read(path)
    assert len(samples) >= 6
    assert max(s.metrics[UTIL] for s in samples) > 0
    memory = "system/gpu_0_memory_usage_" + ("gigabytes" if backend == "rocm" else "megabytes")
    assert min(s.metrics[memory] for s in samples) > 0  # x alone holds 64 MB


def test_sampling_deletes_nothing_through_a_symlink(tmp_path, monkeypatch):
    """``data/system-metrics`` linked to a folder outside the repository: the stage's earlier file is not removed
    there (a CPU run removed it before), and the stage stops with one line before any work."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "trial-float16.json").write_text("{}")
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "system-metrics").symlink_to(outside)
    monkeypatch.chdir(repo)
    with pytest.raises(UserError, match="is a symlink"):
        with sysmetrics.sampling(Path("data/system-metrics/trial-float16.json"), "cpu"):
            pass
    assert (outside / "trial-float16.json").read_text() == "{}"
