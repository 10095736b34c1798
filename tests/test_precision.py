"""Issue 12 and 15.3 on the CPU where a CPU can show it, ``gpu``-marked where only a GPU can: the TF32 switch,
determinism, FP32 regions, RNG capture, resume keys, thread counts and what the manifests record."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _project import ROOT

from pipeline import checkpoint, devices, precision
from pipeline.__main__ import set_thread_env
from pipeline.config import Params, TrialConfig, build
from pipeline.errors import UserError
from pipeline.config import Policy

CPU = torch.device("cpu")
NEW_TF32_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")


def python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: TF32 and determinism flags are process-wide, and a test must not leak them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


# --- TF32: one switch, never a legacy read after the new API ------------------------------------------------


@pytest.mark.skipif(not NEW_TF32_API, reason="torch < 2.9 has only the legacy TF32 flags: nothing to mix")
def test_legacy_tf32_read_after_the_new_api_crashes_and_the_switch_does_not() -> None:
    """Reproduces issue 12.5 on torch >= 2.9 (CPU): a user's module sets the new API, then the old code reads
    the legacy flag and crashes; the one switch (precision.tf32 / strict_fp32) keeps working."""
    code = (
        "import torch\ntorch.backends.cuda.matmul.fp32_precision = 'tf32'  # what a user's model module may do\n"
        "try:\n    torch.backends.cuda.matmul.allow_tf32\nexcept RuntimeError as exc:\n"
        "    print('legacy read:', 'mix of the legacy and new APIs' in str(exc))\n"
        "from pipeline import precision\n"
        "with precision.tf32(False):\n    inside = precision.tf32_state()\n"
        "after = precision.tf32_state()\n"
        "precision.strict_fp32()\n"
        "print(inside, after, precision.tf32_state())"
    )
    proc = python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "legacy read: True",
        "('ieee', 'ieee', 'ieee') ('tf32', 'tf32', 'tf32') ('ieee', 'ieee', 'ieee')",
    ]


def test_tf32_switch_sets_and_restores() -> None:
    saved = precision.tf32_state()
    try:
        with precision.tf32(True):
            on = precision.tf32_state()
            with precision.tf32(False):
                off = precision.tf32_state()
        assert precision.tf32_state() == saved
        if NEW_TF32_API:
            assert set(on) == {"tf32"} and set(off) == {"ieee"}
        else:
            assert set(on) == {True} and set(off) == {False}
    finally:
        precision.set_tf32_state(saved)


def test_no_tf32_flag_is_touched_outside_precision_py() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "pipeline").rglob("*.py"))
        if p.name != "precision.py" and ("allow_tf32" in p.read_text() or "fp32_precision" in p.read_text())
    ]
    assert offenders == [], "every TF32 switch lives in pipeline/precision.py"


# --- determinism ---------------------------------------------------------------------------------------------


def test_deterministic_reports_the_ops_without_a_deterministic_kernel_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # put_ (accumulate=False) has no deterministic kernel, on the CPU too: the one op a CPU can show this with.
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    t = torch.zeros(4)
    try:
        with pytest.raises(UserError) as err:
            with precision.deterministic(True):
                assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
                assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
                t.put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
                t.put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))
                t.index_add_(0, torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))  # deterministic on the CPU
        line = str(err.value)
        assert line.startswith("reference.deterministic: ") and "for put_;" in line and "deterministic: false" in line
        assert "\n" not in line
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
        precision.deterministic(True)  # as a plain call: in force, the first such op raises
        with pytest.raises(RuntimeError) as raised:
            t.put_(torch.tensor([0]), torch.tensor([1.0]))
        assert precision.nondeterministic_op(raised.value) == "put_"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


# --- FP32 regions ----------------------------------------------------------------------------------------------


def test_duplicate_fp32_modules_are_refused_in_config_and_regions_restore_in_reverse() -> None:
    with pytest.raises(UserError, match=r"trial.policies.float16.fp32_modules lists '0' more than once; list each module once"):
        policies = {"float16": {"dtype": "float16", "fp32_modules": ["0", "1", "0"]}}
        build(TrialConfig, {"variants": ["float16"], "policies": policies}, "trial").check("trial")
    # A policy built in code (the diagnosis's candidates) may still name a module twice: two wrappers stack,
    # and restoring in reverse removes both (forward order left the second one installed).
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with precision.fp32_regions(model, Policy(dtype="bfloat16", fp32_modules=("0", "0")), CPU):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model[0](torch.ones(2, 4)).dtype == torch.float32
    assert "forward" not in model[0].__dict__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0](torch.ones(2, 4)).dtype == torch.bfloat16, "module 0 is back under autocast"


# --- RNG -----------------------------------------------------------------------------------------------------


def test_rng_state_round_trips_cpu_and_the_current_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The file format with a (simulated) GPU: the current device's state saved and restored into it; the
    same keys whatever the number of GPUs, so a checkpoint's bytes do not follow the machine's GPU count."""
    gpu_state = torch.arange(16, dtype=torch.uint8)
    set_calls: list[list[int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gpu_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": set_calls.append(state.tolist()))
    torch.manual_seed(3)
    ckpt = checkpoint.capture(torch.nn.Linear(2, 2))
    expected = torch.rand(3)
    checkpoint.save(tmp_path / "c.safetensors", ckpt)
    loaded = checkpoint.load(tmp_path / "c.safetensors")
    assert sorted(k for k in loaded.tensors if k.startswith("rng/")) == ["rng/cpu", "rng/cuda"]
    torch.manual_seed(99)
    checkpoint.restore(loaded, torch.nn.Linear(2, 2))
    assert torch.equal(torch.rand(3), expected)
    assert set_calls == [list(range(16))]
    # A checkpoint saved on a CPU machine leaves the GPU generator alone.
    set_calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_only = checkpoint.capture(torch.nn.Linear(2, 2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    checkpoint.restore(cpu_only, torch.nn.Linear(2, 2))
    assert set_calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_gpu_rng_is_captured_before_cuda_starts_and_restored() -> None:
    torch.manual_seed(5)
    init = checkpoint.capture(torch.nn.Linear(2, 2))  # what freeze does, before any GPU op
    assert "rng/cuda" in init.tensors
    first = torch.rand(8, device="cuda")
    torch.rand(100, device="cuda")
    checkpoint.restore(init, torch.nn.Linear(2, 2))
    assert torch.equal(torch.rand(8, device="cuda"), first)
    dropout = torch.nn.Dropout(0.5).cuda().train()
    checkpoint.restore(init, torch.nn.Linear(2, 2))
    a = dropout(torch.ones(64, device="cuda"))
    checkpoint.restore(init, torch.nn.Linear(2, 2))
    assert torch.equal(dropout(torch.ones(64, device="cuda")), a), "a forward that draws on the GPU repeats"


# --- resume keys ---------------------------------------------------------------------------------------------


def test_resume_state_from_another_torch_or_device_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "resume.safetensors"
    resume = checkpoint.ResumeFile(path, "run-1", CPU)
    assert resume.env == checkpoint.RunEnv(backend="cpu", device_name=devices.describe(CPU).device_name, torch=torch.__version__)
    resume.save(checkpoint.capture(torch.nn.Linear(2, 2), step=4))
    assert resume.load().meta["step"] == 4
    assert checkpoint.ResumeFile(path, "run-2", CPU).load() is None, "another run's state is ignored"
    # The same run's state, as written by another torch (or on a GPU), its sha256 with it: refused, never resumed.
    for other in ({"torch": "2.4.0"}, {"backend": "cuda", "device_name": "NVIDIA H200"}):
        ckpt = checkpoint.load(path)
        ckpt = dataclasses.replace(ckpt, info=dataclasses.replace(ckpt.info, run_env=dataclasses.replace(resume.env, **other)))
        digest = checkpoint.save(path, ckpt)
        resume.sidecar.write_text(f"{digest}  {path.name}\n")
        with pytest.raises(UserError) as err:
            checkpoint.ResumeFile(path, "run-1", CPU).load()
        line = str(err.value)
        assert "\n" not in line and f"delete {path}" in line and list(other.values())[0] in line
    # One byte of the environment damaged (the sidecar still the state's): damage, a warning and a restart, not a
    # refusal that no rerun gets past.
    resume.save(checkpoint.capture(torch.nn.Linear(2, 2), step=4))
    raw = bytearray(path.read_bytes())
    at = raw.find(resume.env.device_name.encode())
    raw[at] ^= 1
    path.write_bytes(bytes(raw))
    assert checkpoint.ResumeFile(path, "run-1", CPU).load() is None


# --- threads and what manifests record -----------------------------------------------------------------------


def test_describe_records_threads_and_blas() -> None:
    env = devices.describe(CPU)
    assert env.threads == torch.get_num_threads() and env.interop_threads == torch.get_num_interop_threads()
    assert env.blas and env.blas != "unknown"


def test_threads_param_goes_to_the_environment_before_torch() -> None:
    assert Params().threads == 1
    assert build(Params, {"threads": None}, "").threads is None
    with pytest.raises(UserError, match="threads is 0; it must be greater than 0"):
        build(Params, {"threads": 0}, "").check()
    environ = {"OMP_NUM_THREADS": "2"}
    set_thread_env(3, environ)
    assert environ == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}
    environ = {"OMP_NUM_THREADS": "2"}
    set_thread_env(None, environ)
    assert environ == {"OMP_NUM_THREADS": "2"}


def test_entry_point_applies_threads_and_imports_no_torch_before_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m pipeline``: a bad params file stops before torch; a good one sets the environment and torch."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("threads: two\n")
    code = (
        f"import sys\nfrom pipeline import __main__ as m\nrc = m.main(['prepare', '--params', {str(bad)!r}])\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    proc = python(code)
    assert proc.stdout.split() == ["2", "False"] and "threads must be an integer" in proc.stderr
    # A good one, in this process, with a stand-in stage that reports what it finds.
    from pipeline import __main__ as entry

    for name in entry.THREAD_VARIABLES:
        monkeypatch.setenv(name, "2")
    seen = {}
    stage = type(sys)("pipeline.stages.prepare")
    stage.main = lambda params_path: seen.update(env=os.environ["OMP_NUM_THREADS"], threads=torch.get_num_threads())
    monkeypatch.setitem(sys.modules, "pipeline.stages.prepare", stage)
    good = tmp_path / "good.yaml"
    good.write_text("threads: 1\n")
    assert entry.main(["prepare", "--params", str(good)]) == 0
    assert seen == {"env": "1", "threads": 1}


# --- on a GPU only -------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@pytest.mark.gpu
@needs_gpu
def test_gpu_strict_fp32_is_ieee_and_the_tf32_switch_works() -> None:
    """Strict FP32 on the GPU agrees with float64 to FP32 accuracy; TF32 (capability 8.0+, CUDA) does not."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 512, device="cuda", generator=gen)
    b = torch.randn(512, 512, device="cuda", generator=gen)
    exact = (a.double() @ b.double()).float()
    with precision.tf32(False):
        strict = (a @ b - exact).abs().max().item()
    with precision.tf32(True):
        loose = (a @ b - exact).abs().max().item()
    assert strict < 1e-3
    env = devices.describe(torch.device("cuda"))
    if devices.tf32_available(env)[0]:
        assert loose > 10 * strict, (strict, loose)


@pytest.mark.gpu
@needs_gpu
def test_gpu_deterministic_training_step_repeats_bit_for_bit() -> None:
    """With precision.deterministic(True) a conv + matmul forward/backward gives the same bits twice."""

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(10)).cuda()
        x = torch.randn(16, 3, 32, 32, device="cuda")
        model(x).square().mean().backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    with precision.deterministic(True):
        first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
@needs_gpu
def test_gpu_resume_key_names_the_gpu(tmp_path: Path) -> None:
    resume = checkpoint.ResumeFile(tmp_path / "r.safetensors", "k", torch.device("cuda"))
    assert resume.env.backend in ("cuda", "rocm") and resume.env.device_name == torch.cuda.get_device_name(0)
    resume.save(checkpoint.capture(torch.nn.Linear(2, 2)))
    with pytest.raises(UserError, match="not backend cpu"):
        checkpoint.ResumeFile(tmp_path / "r.safetensors", "k", CPU).load()


@pytest.mark.integration
def test_cpu_bytes_do_not_follow_omp_num_threads(reproduced, tmp_path: Path) -> None:
    """Issue 15.3: with the default ``threads: 1`` the reference is byte-identical under OMP_NUM_THREADS 1 and 2,
    and its manifest records the counts and the BLAS. Under 1: the session's ``reproduced`` (its stages ran with the
    test session's OMP_NUM_THREADS, 1 unless set); under 2: prepare and freeze again, in a copy."""
    import hashlib
    import json
    import shutil

    from _project import env_for

    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    folders = [repo / "data" / name for name in ("prepared", "reference")]

    def digests() -> dict[str, str]:
        files = sorted(p for f in folders for p in f.rglob("*") if p.is_file())
        return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}

    before = digests()
    env = {**env_for(repo), "OMP_NUM_THREADS": "2"}
    for stage in ("prepare", "freeze"):
        proc = subprocess.run([sys.executable, "-m", "pipeline", stage], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(before) > 5 and digests() == before
    env = json.loads((repo / "data/reference/manifest.json").read_text())["env"]
    assert (env["threads"], env["interop_threads"]) == (1, 1) and env["blas"]
