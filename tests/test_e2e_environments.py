"""Odd environments (issue 15): file modes under a umask, read-only tracking stores, YAML 1.2 numbers.

Unit tests: no `dvc repro`. Read-only folders are real: a read-only bind mount when the tests run as root
(permission bits do not stop root), `chmod 0555` otherwise.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import provenance, tracking

from pipeline import files
from pipeline.config import load_params
from pipeline.errors import UserError


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_outputs_get_the_mode_a_plain_open_would(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        files.write_bytes(tmp_path / "atomic.bin", b"x")
        files.write_json(tmp_path / "atomic.json", {"a": 1})
        with open(tmp_path / "plain.bin", "wb") as handle:
            handle.write(b"x")
        assert files.current_umask() == mask
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plain.bin").stat().st_mode) == mode
    for name in ("atomic.bin", "atomic.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture
def readonly(tmp_path) -> Iterator[Path]:
    """A folder holding an existing file, that nobody (root included) can write into."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "m.db").write_bytes(b"")
    if os.geteuid() != 0:
        src.chmod(0o555)
        yield src
        src.chmod(0o755)
        return
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:  # a container without CAP_SYS_ADMIN: the one case where no read-only folder exists
        pytest.skip(f"root without mount permission cannot make a read-only folder: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("uri", ["sqlite:///{ro}/m.db", "sqlite:///{ro}/new.db", "{ro}/mlruns", "file://{ro}/mlruns", "{ro}"])
def test_read_only_tracking_store_fails_fast_naming_the_path(readonly, uri):
    uri = uri.format(ro=readonly)
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        tracking.Publisher("amp-validation", uri=uri)
    took = time.monotonic() - start
    message = str(info.value)
    assert took < 5, f"{took:.1f} s to refuse {uri}"
    assert "\n" not in message
    assert str(readonly) in message and "not writable" in message and "MLFLOW_TRACKING_URI" in message, message
    assert "maintenance mode" not in message and "fix the tracking server" not in message


def test_plain_path_store_is_refused_with_the_sqlite_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UserError, match=rf"sqlite:///{tmp_path}/mlruns/mlflow.db"):
        tracking.Publisher("amp-validation", uri=str(tmp_path / "mlruns"))


@pytest.mark.parametrize(
    "text, field, value",
    [
        ("prepare: {edge_scales: [1.0e30, 1e-4, 1E5, .5e1, -2.5e-3, 1.0e+30]}", ("prepare", "edge_scales"),
         [1e30, 1e-4, 1e5, 5.0, -2.5e-3, 1e30]),
        ("reference: {lr: 1e-4, boundary_epsilon: 5e-3}", ("reference", "lr"), 1e-4),
        ("reference: {train_steps: 1e2}", ("reference", "train_steps"), 100),
        ("acceptance: {loss_atol: 5e-2}", ("acceptance", "loss_atol"), 0.05),
    ],
)
def test_every_yaml_number_is_a_number(tmp_path, text, field, value):
    if field == ("prepare", "edge_scales"):
        text = text.replace("-2.5e-3, ", "")  # scales must be positive; the sign is tested below
        value = [v for v in value if v > 0]
    (tmp_path / "params.yaml").write_text(text + "\n")
    params = load_params(tmp_path / "params.yaml")
    got = getattr(getattr(params, field[0]), field[1])
    assert got == value and type(got) is type(value)


def test_yaml_numbers_agree_with_dvc_and_words_stay_refused(tmp_path):
    """What DVC (ruamel, YAML 1.2) reads as a number, load_params reads as the same number."""
    from ruamel.yaml import YAML

    text = "reference: {lr: 1e-4, momentum: -0.0e0, train_steps: 12, grad_clip: 2.5E+1}\n"
    (tmp_path / "params.yaml").write_text(text)
    ours = load_params(tmp_path / "params.yaml").reference
    dvcs = YAML(typ="safe", pure=True).load(text)["reference"]
    assert (ours.lr, ours.momentum, ours.train_steps, ours.grad_clip) == (
        dvcs["lr"], dvcs["momentum"], dvcs["train_steps"], dvcs["grad_clip"]
    )
    for bad, words in (
        ("reference: {lr: 1e}", "number"), ("reference: {train_steps: 1.5e0}", "integer"), ("reference: {lr: .inf}", "finite"),
    ):
        (tmp_path / "params.yaml").write_text(bad + "\n")
        with pytest.raises(UserError, match=words):
            load_params(tmp_path / "params.yaml")


def test_default_uri_is_the_repository_database_also_from_a_temp_copy(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    copy = tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "tmpabc123"
    copy.mkdir(parents=True)
    assert provenance.repository_root(copy) == tmp_path / "repo"
    monkeypatch.chdir(copy)
    assert tracking.tracking_uri() == f"sqlite:///{(tmp_path / 'repo').resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    assert tracking.tracking_uri() == "http://127.0.0.1:1"


def test_mlflow_keys():
    assert tracking.mlflow_key("acceptance.outputs.*.atol") == "acceptance.outputs.default.atol"
    assert tracking.mlflow_key("values.logits[0].max_abs") == "values.logits_0_.max_abs"
    assert len(tracking.mlflow_key("x" * 400)) == 250
    assert files.flatten({"a": {"b": 1, "c": {}}, "d": [1]}) == {"a.b": 1, "a.c": {}, "d": [1]}


def test_a_sqlite_store_lock_held_too_long_is_one_line(tmp_path, monkeypatch):
    """Publishers of one sqlite database take turns (its creation and migration are not safe to run twice at
    once); one that waited past the limit says who holds the lock instead of a traceback."""
    import sys

    monkeypatch.setattr(tracking, "_LOCK_TIMEOUT_S", 0.5)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, filelock; from pipeline import tracking\n"
         f"lock = tracking._store_lock({uri!r})\nlock.__enter__(); print('held', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(UserError, match=r"another publish to .*mlflow\.db has held its lock"):
            with tracking._store_lock(uri):
                pass
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait()
    lock = tracking._store_lock(uri)
    with lock, lock:  # free again, and re-entrant (a Publisher enters its lock in __init__ and publish)
        pass
