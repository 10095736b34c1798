"""Publishing to a real `mlflow server` on 127.0.0.1, read back through the MLflow client.

One server per module (it takes seconds to start on 2 cores); each test copies the session's reproduced
project before publishing, and reads what the server holds afterwards. No mock anywhere. Concurrency is
real too: two publisher processes at once against the server.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from _project import BIN, dvc, env_for, run, write_params

from pipeline import tracking

pytestmark = pytest.mark.integration

def dtypes_of(repo: Path) -> list[str]:
    return yaml.safe_load((repo / "params.yaml").read_text())["trial"]["variants"]


def parents_of(runs: list) -> list:
    return [r for r in runs if "mlflow.parentRunId" not in r.data.tags]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """A real tracking server with a temporary sqlite backend and artifact store, up until the module ends."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    with open(root / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no background job workers: CPU for the tests
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(uri + "/health", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the uvicorn worker it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def publish(repo: Path, uri: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**env_for(repo), "MLFLOW_TRACKING_URI": uri}
    start = time.monotonic()
    proc = run([sys.executable, "-m", "pipeline", "publish"], repo, check=False, env=env, timeout=300)
    return proc, time.monotonic() - start


def fingerprint(repo: Path) -> dict[str, str]:
    """sha256 of every DVC output and of dvc.lock: what must survive a failed publish untouched."""
    files = [p for p in (repo / "data").rglob("*") if p.is_file()] + [repo / "dvc.lock"]
    return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(files)}


def client(uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def runs_of(uri: str, experiment: str = "amp-validation") -> list:
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else list(c.search_runs([exp.experiment_id], max_results=1000))


def models_of(uri: str, experiment: str = "amp-validation", query: str | None = None) -> list:
    """LoggedModels of the experiment, through MLflow 3's public query (deleted ones are not returned)."""
    c = client(uri)
    return list(c.search_logged_models([c.get_experiment_by_name(experiment).experiment_id], filter_string=query))


def artifacts(c, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for a in c.list_artifacts(run_id, path):
        out |= artifacts(c, run_id, a.path) if a.is_dir else {a.path}
    return out


def read(repo: Path, rel: str):
    return json.loads((repo / rel).read_text())


@pytest.fixture(scope="module")
def story(reproduced, server, tmp_path_factory) -> dict:
    """Publish against a server that is down, one that hangs, then the live one twice; record everything."""
    repo = tmp_path_factory.mktemp("publish") / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    out: dict = {"repo": repo, "uri": server}
    before = fingerprint(repo)
    out["down"] = publish(repo, f"http://127.0.0.1:{free_port()}")
    with socket.socket() as hung:  # accepts connections, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        out["hung"] = publish(repo, f"http://127.0.0.1:{hung.getsockname()[1]}")
    out["intact"] = fingerprint(repo) == before
    out["first"] = publish(repo, server)
    out["runs_after_first"] = len(runs_of(server))
    out["models_after_first"] = len(models_of(server))
    out["second"] = publish(repo, server)
    out["runs_after_second"] = len(runs_of(server))
    out["models_after_second"] = len(models_of(server))
    # What a publish killed midway leaves: a parent that never reached FINISHED, a child missing.
    c = client(server)
    runs = runs_of(server)
    out["old_parent"] = next(r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags)
    c.update_run(out["old_parent"], status="RUNNING")
    c.set_tag(out["old_parent"], tracking.HEARTBEAT_TAG, str(int((time.time() - 2 * tracking.LEASE_S) * 1000)))  # killed long ago
    missing = next(r.info.run_id for r in runs if "mlflow.parentRunId" in r.data.tags)
    for model in models_of(server):  # never created, as the run was not
        if model.source_run_id == missing:
            c.delete_logged_model(model.model_id)
    c.delete_run(missing)
    out["redo"] = publish(repo, server)
    return out


def test_unreachable_server_fails_fast_in_one_line_and_leaves_outputs(story):
    for case in ("down", "hung"):
        proc, took = story[case]
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (case, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, proc.stderr)
        assert "unreachable" in lines[0] and "python -m pipeline publish" in lines[0], lines[0]
        assert "Traceback" not in proc.stderr
        assert took < 20, f"{case}: publish took {took:.1f} s to give up"
    assert story["intact"], "a failed publish changed DVC outputs or dvc.lock"


def test_publish_later_creates_the_whole_tree_once(story):
    proc, took = story["first"]
    assert proc.returncode == 0, proc.stderr
    expected = 1 + len(dtypes_of(story["repo"]))  # parent + one run per dtype
    assert story["runs_after_first"] == expected
    assert f"{expected} run(s) created" in proc.stdout
    print(f"\npublish to {story['uri']}: {took:.1f} s for {expected} runs")


def test_publish_prints_the_verdict_last_and_a_link_in_model_training_mode(story):
    proc, _ = story["first"]
    exp = client(story["uri"]).get_experiment_by_name("amp-validation").experiment_id
    last = proc.stdout.strip().splitlines()[-1]
    assert last.endswith(f"review: {story['uri']}/#/experiments/{exp}/runs?workflowType=machine_learning"), last
    for d in dtypes_of(story["repo"]):
        decision = read(story["repo"], f"data/decision/{d}/decision.json")["decision"]
        assert f"{d} {decision.upper()}" in last
    assert "workflowType=machine_learning" in proc.stdout.strip().splitlines()[-2]  # the parent run's own page


def test_the_experiment_is_typed_for_model_training_created_or_reused(story, server):
    """MLflow 3 opens an experiment tagged ``mlflow.experimentKind`` = custom_model_development on its runs table
    from the home page; an untyped one (an older version's) opens in GenAI mode, and is typed when reused."""
    c = client(story["uri"])
    assert c.get_experiment_by_name("amp-validation").tags[tracking.KIND_TAG] == "custom_model_development"
    old = c.create_experiment("untyped")
    assert tracking.KIND_TAG not in c.get_experiment(old).tags
    assert tracking.Publisher("untyped", uri=server).experiment_id == old
    assert c.get_experiment(old).tags[tracking.KIND_TAG] == "custom_model_development"


def test_republishing_adds_nothing(story):
    proc, _ = story["second"]
    assert proc.returncode == 0, proc.stderr
    assert "already published" in proc.stdout and story["uri"] in proc.stdout
    assert story["runs_after_second"] == story["runs_after_first"]


def test_one_child_per_dtype_named_by_its_decision_and_tagged(story):
    repo, uri = story["repo"], story["uri"]
    runs = runs_of(uri)
    parents = parents_of(runs)
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags[tracking.KEY_TAG]
    dtypes = dtypes_of(repo)
    decisions = {d: read(repo, f"data/decision/{d}/decision.json") for d in dtypes}
    order = sorted(dtypes, key=lambda d: decisions[d]["decision"] == "accept")  # rollbacks first
    mark, short = {"accept": "✓", "rollback": "✗"}, {"float16": "fp16", "bfloat16": "bf16"}
    verdicts = ", ".join(f"{mark[decisions[d]['decision']]} {short[d]}" for d in order)
    assert parent.info.run_name.startswith(verdicts) and len(verdicts) <= 15  # what the runs table shows uncut
    children = {r.info.run_name: r for r in runs if r is not parent}
    assert set(children) == {f"{decisions[d]['decision'].upper()} {d}" for d in dtypes}
    manifest = read(repo, "data/reference/manifest.json")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    for d in dtypes:
        r = children[f"{decisions[d]['decision'].upper()} {d}"]
        tags = r.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id and r.info.status == "FINISHED"
        assert tags["git_commit"] == commit and tags["rule_sha256"] == manifest["rule_sha256"]
        assert (
            tags["backend"] in ("cpu", "cuda", "rocm") and tags["device_name"]
            and tags["torch_version"] == manifest["env"]["torch"]
        )
        assert tags["stage"] == "variant" and tags["dtype"] == d
        assert tags["decision"] == decisions[d]["decision"] and tags["reasons_count"] == str(len(decisions[d]["reasons"]))
        assert json.loads(tags["rule_json"]) == decisions[d]["rule"]
        assert parent.data.tags[f"decision.{d}"] == decisions[d]["decision"]
        note = tags["mlflow.note.content"]
        assert note.startswith("## Verdict") and f"**{d}: {decisions[d]['decision'].upper()}" in note
    assert "dvc_experiment" not in parent.data.tags  # not run by `dvc exp run`


def test_parent_description_opens_with_the_verdict_and_keeps_hashes_for_the_footer(story):
    parent = parents_of(runs_of(story["uri"]))[0]
    note = parent.data.tags["mlflow.note.content"]
    manifest = read(story["repo"], "data/reference/manifest.json")
    first = note.splitlines()[: len(dtypes_of(story["repo"]))]  # what MLflow shows before "Show more"
    for d, line in zip(dtypes_of(story["repo"]), first):
        assert line.startswith(f"**{d}: {read(story['repo'], f'data/decision/{d}/decision.json')['decision'].upper()}**"), first
    assert note.index("## Verdict") < note.index("## Key figures") < note.index(manifest["rule_sha256"])
    for d in dtypes_of(story["repo"]):
        decision = read(story["repo"], f"data/decision/{d}/decision.json")
        assert f"**{d}: {decision['decision'].upper()}" in note.split("## Key figures")[0]
        if decision["decision"] == "rollback":
            assert f"python -m pipeline restore --variant {d}" in note


def test_params_are_flattened_from_params_yaml(story):
    parent = parents_of(runs_of(story["uri"]))[0]
    params = parent.data.params
    raw = yaml.safe_load((story["repo"] / "params.yaml").read_text())
    assert params["reference.train_steps"] == str(raw["reference"]["train_steps"])
    assert json.loads(params["trial.variants"]) == raw["trial"]["variants"]
    # `*` is not a valid MLflow key
    assert float(params["acceptance.outputs.default.atol"]) == raw["acceptance"]["outputs"]["*"]["atol"]
    assert params["tracking.experiment"] == "amp-validation"


def test_decision_and_key_figures_are_columns_and_curves_have_gap_and_band(story):
    repo, c = story["repo"], client(story["uri"])
    runs = runs_of(story["uri"])
    ref_steps = read(repo, "data/reference/trajectory.json")["steps"]
    for d in dtypes_of(repo):
        decision = read(repo, f"data/decision/{d}/decision.json")
        stats = read(repo, f"data/compare/{d}/stats.json")
        run = next(r for r in runs if r.data.tags.get("dtype") == d)
        steps = read(repo, f"data/trial/{d}/trajectory.json")["steps"]
        for key, field, source in (
            ("loss_amp", "loss", steps), ("loss_fp32", "loss", ref_steps), ("loss_scale", "scale", steps),
            ("grad_norm", "grad_norm", steps),
        ):
            history = sorted(c.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
            assert [m.step for m in history] == [s["step"] for s in source], key
            assert [m.value for m in history] == pytest.approx([s[field] for s in source], rel=1e-12), key
        ref = {s["step"]: s["loss"] for s in ref_steps}
        gap = sorted(c.get_metric_history(run.info.run_id, "loss_gap_abs"), key=lambda m: m.step)
        assert [m.value for m in gap] == pytest.approx([abs(s["loss"] - ref[s["step"]]) for s in steps], rel=1e-9, abs=1e-12)
        band = sorted(c.get_metric_history(run.info.run_id, "loss_band"), key=lambda m: m.step)
        rule = decision["rule"]
        stated = rule["loss_atol"] is not None or rule["loss_rtol"] is not None  # else no band: the noise floor judges
        assert [m.value for m in band] == pytest.approx(
            [(rule["loss_atol"] or 0) + (rule["loss_rtol"] or 0) * abs(ref[s["step"]]) for s in steps] if stated else []
        )
        m = run.data.metrics
        assert m["accepted"] == float(decision["decision"] == "accept")
        assert m["flips"] == stats["flips"]["flips"] and m["near_boundary_flips"] == stats["flips"]["near_boundary_flips"]
        assert m["boundary_flips"] == stats["flips"]["boundary_flips"]
        assert m["max_abs_gap"] == pytest.approx(max(v["max_abs"] for v in stats["values"].values()))
        assert m["quality_trial"] == pytest.approx(stats["quality"]["trial"]) and m["max_loss_gap"] == pytest.approx(
            stats["training"]["max_loss_gap"]
        )
        assert not any("arbiter" in k for k in m) and not any(k.endswith("_bytes") for k in m)  # renamed, with units
        bench = read(repo, f"data/benchmark/{d}/benchmark.json")
        if bench.get("benchmarked"):
            assert m["speedup_median"] == pytest.approx(bench["speedup"]["median"])
            assert m["step_ms.amp"] == pytest.approx(1000 * bench["seconds_per_step"]["amp"]["median"])
            assert m["process_peak_mib.fp32"] == pytest.approx(bench["peak_memory_bytes"]["fp32"]["median"] / 2**20)
            assert "working_mib.fp32" in m and "working_memory_ratio" in m
        assert len(m) < 40, sorted(m)  # columns a reviewer reads, not 248
        if run.data.tags["backend"] == "cpu":  # MLflow's system metrics are for GPU runs only
            assert not any(k.startswith("system/") for k in m), sorted(m)


def test_artifacts_a_reviewer_opens(story, tmp_path):
    repo, uri = story["repo"], story["uri"]
    c = client(uri)
    runs = runs_of(uri)
    parent = parents_of(runs)[0]
    assert {
        "report.html", "summary.md", "params.yaml", "dvc.lock", "reference/manifest.json", "reference/trajectory.json",
    } <= artifacts(c, parent.info.run_id)
    dtypes = dtypes_of(repo)
    for d in dtypes:
        run = next(r for r in runs if r.data.tags.get("dtype") == d)
        have = artifacts(c, run.info.run_id)
        assert {f"plots/{n}.png" for n in ("loss", "scale", "envelope", "errors")} <= have
        assert {
            "decision.json", "cases.json", "stages/compare/stats.json", "stages/trial/trajectory.json",
            "stages/diagnose/diagnosis.json",
        } <= have
        if (repo / f"data/diagnose/{d}/suggested_params.yaml").is_file():
            assert "suggested_params.yaml" in have
        if (repo / f"data/decision/{d}/rollback").is_dir():
            assert {f"rollback/{p.name}" for p in (repo / f"data/decision/{d}/rollback").iterdir()} <= have
        # The per-case table, as MLflow logged it (pandas "split" orient), row for row.
        table = json.loads(Path(c.download_artifacts(run.info.run_id, "cases.json", str(tmp_path))).read_text())
        cases = read(repo, f"data/compare/{d}/cases.json")
        assert table["columns"][:2] == ["id", "kind"] and "flipped" in table["columns"]
        flipped_first = sorted(cases, key=lambda case: not case["flipped"])
        assert [row[0] for row in table["data"]] == [case["id"] for case in flipped_first]
    report = Path(c.download_artifacts(parent.info.run_id, "report.html", str(tmp_path))).read_text()
    assert report.count('src="data:image/png;base64,') == 4 * len(dtypes)
    assert report.index('<section id="verdict">') < report.index('<table class="summary">')
    for d in dtypes:
        assert f'<h2 id="{d}">' in report
        for reason in read(repo, f"data/decision/{d}/decision.json")["reasons"]:
            assert html.escape(reason) in report


def test_each_checkpoint_is_a_logged_model_a_query_finds_with_its_decision(story, tmp_path):
    """MLflow 3's Models tab: each dtype's trained checkpoint and the reference's as LoggedModels of their runs, their
    files safetensors only, with the decision, the rule's sha256 and the key figures; found by a query, once."""
    import mlflow

    repo, uri = story["repo"], story["uri"]
    c = client(uri)
    dtypes = dtypes_of(repo)
    assert story["models_after_first"] == story["models_after_second"] == 1 + len(dtypes)  # republishing adds none
    assert len(models_of(uri)) == 1 + len(dtypes)  # the interrupted publish redone: its models went with its runs
    manifest = read(repo, "data/reference/manifest.json")

    def files_of(model) -> dict[str, str]:
        folder = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=model.artifact_location, dst_path=str(tmp_path / model.model_id), tracking_uri=uri
        ))
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}

    def sha(rel: str) -> str:
        return hashlib.sha256((repo / rel).read_bytes()).hexdigest()

    for d in dtypes:
        decision = read(repo, f"data/decision/{d}/decision.json")
        stats = read(repo, f"data/compare/{d}/stats.json")
        other = "rollback" if decision["decision"] == "accept" else "accept"
        assert models_of(uri, query=f"tags.dtype = '{d}' AND tags.decision = '{other}'") == []
        found = models_of(uri, query=f"tags.dtype = '{d}' AND tags.decision = '{decision['decision']}'")
        assert len(found) == 1, found
        model = found[0]
        assert model.name == f"{decision['decision'].upper()} {d}" and str(model.status) == "READY"
        assert model.tags["rule_sha256"] == manifest["rule_sha256"] and json.loads(model.tags["rule_json"]) == decision["rule"]
        assert model.params["loss_atol"] == json.dumps(decision["rule"]["loss_atol"])  # null: no fixed band (the default)
        run = c.get_run(model.source_run_id)
        assert run.data.tags["dtype"] == d and [o.model_id for o in run.outputs.model_outputs] == [model.model_id]
        metrics = {m.key: m.value for m in model.metrics}
        assert metrics["accepted"] == float(decision["decision"] == "accept") and metrics["flips"] == stats["flips"]["flips"]
        assert metrics["quality_trained"] == pytest.approx(stats["quality"]["trained"])
        assert len(c.get_metric_history(run.info.run_id, "flips")) == 1  # the run's own metric, linked, not logged twice
        assert files_of(model) == {"checkpoint.safetensors": sha(f"data/trial/{d}/checkpoint.safetensors")}  # nothing pickled
    (ref,) = models_of(uri, query="tags.stage = 'reference'")
    assert ref.name == "reference float32" and ref.source_run_id == parents_of(runs_of(uri))[0].info.run_id
    assert {m.key for m in ref.metrics} == {"reference.real_updates", "reference.final_loss"}  # the parent's names
    assert files_of(ref) == {"checkpoint.safetensors": sha("data/reference/checkpoint.safetensors")}


def test_interrupted_publish_is_redone_once(story):
    """A parent left RUNNING without a heartbeat for longer than the lease (publish killed midway) is replaced
    by one complete tree, not duplicated."""
    proc, _ = story["redo"]
    assert proc.returncode == 0, proc.stderr
    runs = runs_of(story["uri"])
    assert len(runs) == story["runs_after_first"]
    assert all(r.info.status == "FINISHED" for r in runs)
    parent = parents_of(runs)
    assert len(parent) == 1 and parent[0].info.run_id != story["old_parent"]
    assert {r.data.tags["mlflow.parentRunId"] for r in runs if r is not parent[0]} == {parent[0].info.run_id}


def test_two_publishers_at_once_publish_one_tree(reproduced, server, tmp_path):
    """Two clones of the same results publish at the same moment, in two processes: one tree, no error,
    nothing deleted under the other's feet (issue 15: one took the other's live parent for interrupted)."""
    repos = []
    for name in ("a", "b"):
        repo = tmp_path / name
        shutil.copytree(reproduced, repo, symlinks=True)
        write_params(repo, {"tracking": {"experiment": "concurrent"}})
        repos.append(repo)
    procs = [
        subprocess.Popen([sys.executable, "-m", "pipeline", "publish"], cwd=repo,
                         env={**env_for(repo), "MLFLOW_TRACKING_URI": server},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for repo in repos
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "Traceback" not in err and "fix the tracking server" not in err
    stdout = [out for out, _ in outs]
    assert sum("run(s) created" in out for out in stdout) == 1, stdout
    assert sum("already published" in out for out in stdout) == 1, stdout
    runs = runs_of(server, "concurrent")
    assert len(parents_of(runs)) == 1 and len(runs) == 1 + len(dtypes_of(repos[0]))
    assert all(r.info.status == "FINISHED" for r in runs)


def spec(name: str = "x") -> tracking.RunSpec:
    return tracking.RunSpec(name=name, tags={"stage": "test"}, metrics={"m": 1.0})


def test_a_live_publish_is_waited_for_and_a_stale_one_taken_over(server):
    publisher = tracking.Publisher("lease", uri=server, wait_s=1.0)
    c = client(server)
    live = c.create_run(
        publisher.experiment_id, tags={tracking.KEY_TAG: "k1", tracking.HEARTBEAT_TAG: str(int(time.time() * 1000))}
    ).info.run_id
    start = time.monotonic()
    with pytest.raises(tracking.UserError, match="still running"):
        publisher.publish("k1", spec(), [spec("child")])
    assert time.monotonic() - start < 30
    assert c.get_run(live).info.lifecycle_stage == "active"  # a live publish is never deleted
    c.set_tag(live, tracking.HEARTBEAT_TAG, str(int((time.time() - 2 * tracking.LEASE_S) * 1000)))
    published = publisher.publish("k1", spec(), [spec("child")])
    assert published.created == 2 and c.get_run(live).info.lifecycle_stage == "deleted"


def test_a_rerun_removes_duplicates_and_orphans(server):
    """What two publishers whose clocks disagree, or an old version, could leave: a second finished tree and
    children whose parent is gone. The next publish keeps the first tree and deletes the rest."""
    publisher = tracking.Publisher("dedupe", uri=server)
    first = publisher.publish("k2", spec(), [spec("child")])
    c = client(server)
    exp = publisher.experiment_id
    dup = c.create_run(exp, tags={tracking.KEY_TAG: "k2"}).info.run_id
    c.create_run(exp, tags={"mlflow.parentRunId": dup, tracking.MEMBER_TAG: "k2"})
    gone = c.create_run(exp, tags={tracking.KEY_TAG: "k2"}).info.run_id
    c.create_run(exp, tags={"mlflow.parentRunId": gone, tracking.MEMBER_TAG: "k2"})
    c.set_terminated(dup, "FINISHED")
    c.delete_run(gone)
    again = publisher.publish("k2", spec(), [spec("child")])
    assert (again.run_id, again.created, again.removed) == (first.run_id, 0, 3)
    left = runs_of(server, "dedupe")
    assert len(left) == 2 and {r.info.run_id for r in parents_of(left)} == {first.run_id}


def test_publish_flags_an_accept_under_a_rule_loosened_since_a_rollback(server):
    """The loosened-rule flag comes from the runs published before (decide no longer reads MLflow)."""
    from pipeline.present import runs

    publisher = tracking.Publisher("loosened", uri=server)
    strict = {"outputs": {"*": {"atol": 0.001, "rtol": 0.0}}, "max_failing_fraction": 0.0}
    loose = {"outputs": {"*": {"atol": 0.01, "rtol": 0.0}}, "max_failing_fraction": 0.0}
    c = client(server)
    c.create_run(publisher.experiment_id, tags={"dtype": "bfloat16", "decision": "rollback", "reference_run_key": "R",
                                               "rule_json": json.dumps(strict), "rule_sha256": "s" * 64})
    removed = {**strict, "a_criterion_since_removed": 1.0}  # a rule of another version: not comparable, left out
    c.create_run(publisher.experiment_id, tags={"dtype": "bfloat16", "decision": "rollback", "reference_run_key": "R",
                                               "rule_json": json.dumps(removed), "rule_sha256": "t" * 64})
    from dataclasses import replace

    from pipeline.artifacts.decision import Decision

    accept = Decision(variant="bfloat16", decision="accept", reasons=[], checks=[], rule=loose, rule_sha256="", policy={},
                      env={})
    earlier = publisher.earlier_rollbacks("R", "bfloat16")
    assert [e.rule_sha256 for e in earlier] == ["s" * 64] and earlier[0].rule.outputs["*"].atol == 0.001
    assert runs.loosened(accept, earlier) == [f"outputs.*.atol 0.001 -> 0.01 (rolled back under rule {'s' * 12})"]
    assert publisher.earlier_rollbacks("other reference", "bfloat16") == []
    assert publisher.earlier_rollbacks("R", "float16") == []
    # Named variants: bfloat16_inductor's rollback (dtype bfloat16 too) is its own, never bfloat16's, and is found by name.
    tighter = {**strict, "outputs": {"*": {"atol": 0.0001, "rtol": 0.0}}}
    c.create_run(publisher.experiment_id, tags={"variant": "bfloat16_inductor", "dtype": "bfloat16", "decision": "rollback",
                                               "reference_run_key": "R", "rule_json": json.dumps(tighter),
                                               "rule_sha256": "u" * 64})
    assert [e.rule_sha256 for e in publisher.earlier_rollbacks("R", "bfloat16")] == ["s" * 64]
    assert [e.rule_sha256 for e in publisher.earlier_rollbacks("R", "bfloat16_inductor")] == ["u" * 64]
    assert runs.loosened(replace(accept, rule=strict), earlier) == []
    assert runs.loosened(replace(accept, decision="rollback"), earlier) == []


def test_batches_non_finite_values_and_awkward_names_reach_the_server(server):
    """Past MLflow's per-call limits (100 params, 1000 metrics), NaN/inf kept, refused characters renamed."""
    spec = tracking.RunSpec(
        name="limits",
        tags={"stage": "test"},
        params={f"p.{i}": i for i in range(150)} | {"outputs.*.atol": 0.1, "outputs.a*b": 1, "outputs.a_b": 2},
        metrics={"nan": math.nan, "inf": math.inf, "flag": True, "text": "ignored"},
        steps={"curve": [(i, float(i)) for i in range(2500)], "nan": [(0, 1.0)]},
    )
    published = tracking.Publisher("limits", uri=server).publish("limits-key", spec, [])
    c = client(server)
    r = c.get_run(published.run_id)
    assert len(r.data.params) == 153
    assert r.data.params["outputs.default.atol"] == "0.1"
    assert {r.data.params["outputs.a_b"], r.data.params["outputs.a_b_2"]} == {"1", "2"}
    assert math.isnan(r.data.metrics["nan"]) and r.data.metrics["inf"] > 1e300 and r.data.metrics["flag"] == 1.0
    assert "text" not in r.data.metrics and r.data.metrics["nan_2"] == 1.0
    assert [m.step for m in sorted(c.get_metric_history(published.run_id, "curve"), key=lambda m: m.step)] == list(range(2500))
    assert tracking.Publisher("limits", uri=server).publish("limits-key", spec, []).created == 0


def test_stale_params_are_refused_before_contacting_mlflow(reproduced, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    write_params(repo, {"reference": {"lr": 0.5}})
    proc, _ = publish(repo, f"http://127.0.0.1:{free_port()}")
    assert proc.returncode == 2
    assert "reference" in proc.stderr and "dvc repro" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_dvc_exp_run_temp_publishes_to_the_workspace_database(reproduced, tmp_path):
    """`dvc exp run --temp -S trial.variants=[bfloat16]`: the default URI still points at <repo>/mlflow.db."""
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "reproduced"], repo)
    env = env_for(repo)
    del env["MLFLOW_TRACKING_URI"]  # the default: sqlite:///<repository root>/mlflow.db
    before = {r.info.run_id for r in runs_of(f"sqlite:///{repo / 'mlflow.db'}")}
    proc = run(
        [str(BIN / "dvc"), "exp", "run", "--temp", "-n", "bf16-only", "-S", "trial.variants=[bfloat16]"], repo, env=env,
        timeout=600
    )
    assert "publish" in proc.stdout
    runs = [r for r in runs_of(f"sqlite:///{repo / 'mlflow.db'}") if r.info.run_id not in before]
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parent) == 1 and parent[0].data.tags["dvc_experiment"] == "bf16-only"
    assert {r.data.tags.get("dtype") for r in runs} == {None, "bfloat16"}
    assert not list((repo / ".dvc" / "tmp").rglob("mlflow.db")), "a database was created inside the temporary copy"
    shown = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    names = [e.get("name") for c in shown for e in (c.get("experiments") or [])]
    assert "bf16-only" in names


def test_the_printed_link_opens_the_verdict_in_model_training_mode_in_a_browser(story, tmp_path):
    """Headless Chromium on the parent-run link publish prints: MLflow 3 in model-training mode, the run named
    by its decisions, and the description's first lines giving every dtype's verdict."""
    from test_e2e_browser import FLAGS, chromium

    link = next(w for w in story["first"][0].stdout.strip().splitlines()[-2].split() if w.startswith(story["uri"]))
    dom = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=20000",
                          "--dump-dom", link],
                         capture_output=True, text=True, timeout=180, check=True).stdout
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    assert "Model training" in text
    for d in dtypes_of(story["repo"]):
        decision = read(story["repo"], f"data/decision/{d}/decision.json")["decision"].upper()
        assert f"{d}: {decision}" in re.sub(r"\s+", " ", text), d


VISIBLE = """(() => {
  const want = %s;
  const name = [...document.querySelectorAll("a, span")].find(e => e.childElementCount === 0 && e.textContent.startsWith(want));
  if (!name) return null;
  const range = document.createRange();
  range.setStart(name.firstChild, 0);
  range.setEnd(name.firstChild, want.length);
  let clip = name;  // the box that cuts the name with an ellipsis
  while (clip.parentElement && getComputedStyle(clip).overflowX === "visible") clip = clip.parentElement;
  return {end: range.getBoundingClientRect().right, edge: clip.getBoundingClientRect().right};
})()"""


def test_from_mlflows_home_page_the_runs_list_reads_every_verdict_uncut(story, tmp_path):
    """A reviewer on MLflow's home page: the experiment listed, opened on its runs table in the model-training view,
    where the parent's name gives every dtype's verdict uncut, without expanding a row or widening a column.

    MLflow 3.17 picks the view for its whole UI (the sidebar's GenAI / Model training switch: GenAI until the browser
    is told otherwise, then remembered), and reads ``mlflow.experimentKind`` only where that switch is off: without
    the click the experiment opens on GenAI's overview. The README tells a reviewer to click "Model training" once."""
    from test_e2e_browser import Browser

    repo, uri = story["repo"], story["uri"]
    exp = client(uri).get_experiment_by_name("amp-validation").experiment_id
    decisions = {d: read(repo, f"data/decision/{d}/decision.json")["decision"] for d in dtypes_of(repo)}
    mark, short = {"accept": "✓", "rollback": "✗"}, {"float16": "fp16", "bfloat16": "bf16"}
    verdicts = ", ".join(f"{mark[decisions[d]]} {short[d]}" for d in sorted(decisions, key=lambda d: decisions[d] == "accept"))
    with Browser(tmp_path / "profile") as page:
        page.go(f"{uri}/")
        page.wait("document.body.innerText.includes('Recent Experiments')")  # the home page
        page.click_until("span", "Model training", "localStorage.getItem('mlflow.workflowType_v1') === '\"machine_learning\"'")
        # the sidebar's list of all: the home page shows the 5 most recent only
        page.click_until("a", "Experiments", "location.hash === '#/experiments'")
        runs_view = f"location.hash.startsWith('#/experiments/{exp}/runs')"
        page.click_until("a", "amp-validation", f"{runs_view} && location.hash.includes('workflowType=machine_learning')")
        shown = page.wait(VISIBLE % json.dumps(verdicts))
        assert shown["end"] + 12 <= shown["edge"], (verdicts, shown)  # room left for the ellipsis: nothing cut
        text = page.js("document.body.innerText")
        assert "reference float32" in text  # the Models column: the parent's logged model
