"""Compare's C kernels (``pipeline.compare.native``) against torch's path, the definition of every statistic.

Each case is built so that the kernels' shortcuts meet what they must hand back to torch: zeros in the reference
(no relative error), a non-finite element, a slice near the tolerance, ties at the k-th best, rows far apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import stat
import subprocess

import pytest
import torch

from pipeline.compare import native, streams
from pipeline.compare.decisions import (DecisionStats, _top, best_rows, best_two, decided_pair, kl_and_lse, labels_and_lse,
                                        labels_of, margins)
from pipeline.compare.gaps import GapStats
from pipeline.config import AcceptanceConfig

from tests._steps import step


def test_the_kernels_compile_here_and_small_outputs_never_ask_for_them():
    assert native.available(), "a C compiler is part of the test machine (CI installs gcc)"
    assert not native.wanted(native.MIN_ELEMENTS - 1)
    assert native.wanted(native.MIN_ELEMENTS)
    assert not native.wanted(native.MIN_ELEMENTS, "meta")  # a GPU's compare stays on its device


def test_without_a_compiler_torch_computes_everything(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native.library.cache_clear()
    try:
        assert native.library() is None and not native.wanted(native.MIN_ELEMENTS)
        assert not GapStats(0.1, 0.0, 10, kernels=True).kernels
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.available()


@pytest.fixture(scope="module")
def good_build(tmp_path_factory):
    """One verified build (library and sidecar), copied into each test's own cache instead of compiling again."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(folder))
        native.library.cache_clear()
        try:
            assert native.library() is not None
        finally:
            native.library.cache_clear()
    files = sorted((folder / "amp-validation").iterdir())
    assert [f.suffix for f in files] == [".sha256", ".so"]
    return {f.suffix: f.read_bytes() for f in files}, files[1].stem


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A cache folder of this test's own (``XDG_CACHE_HOME``), and ``library`` loaded afresh in it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    native.library.cache_clear()
    yield tmp_path / "home-cache" / "amp-validation"
    monkeypatch.undo()
    native.library.cache_clear()


def _seed(folder, good_build, so: bytes | None = None, digest: bytes | None = None):
    """The cache holding the good build, or ``so`` (with ``digest``, else the good build's) in its place."""
    (files, stem) = good_build
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    lib, side = folder / f"{stem}.so", folder / f"{stem}.sha256"
    lib.write_bytes(files[".so"] if so is None else so)
    side.write_bytes(files[".sha256"] if digest is None else digest)
    for f in (lib, side):
        f.chmod(0o600)
    return lib, side


def _kernels_agree_with_torch():
    """The loaded kernels give torch's gap statistics (a planted library's answers would not)."""
    r, t = _gap_sides(0)
    a, b = GapStats(0.1, 0.0, 10**6, kernels=False), GapStats(0.1, 0.0, 10**6, kernels=True)
    assert b.kernels
    a.update(r, t, group="ordinary")
    b.update(r, t, group="ordinary")
    x, y = a.result(), b.result()
    assert (y.failing, y.max_abs, y.p99_abs, y.max_rel) == (x.failing, x.max_abs, x.p99_abs, x.max_rel)


def _planted(tmp_path, marker, missing: str = "") -> bytes:
    """A shared library whose constructor writes ``marker`` and whose kernels answer nonsense (``missing`` left out)."""
    stubs = {"gap_slice": "int gap_slice(void) { return 0; }", "decide_rows": "void decide_rows(void) {}",
             "best_rows": "void best_rows(void) {}"}
    src = tmp_path / "planted.c"
    src.write_text("#include <stdio.h>\n"
                   f'__attribute__((constructor)) static void ran(void) {{ FILE *f = fopen("{marker}", "w"); '
                   'if (f) fclose(f); }\n' + "\n".join(v for k, v in stubs.items() if k != missing) + "\n")
    out = tmp_path / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out.read_bytes()


def test_the_library_is_compiled_once_into_the_cache(cache):
    assert native.library() is not None
    files = sorted(cache.iterdir())
    assert [f.suffix for f in files] == [".sha256", ".so"]  # nothing half-written left beside them
    so, side = files[1], files[0]
    assert side.read_text().strip() == hashlib.sha256(so.read_bytes()).hexdigest()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and stat.S_IMODE(so.stat().st_mode) == 0o600
    stamp = so.stat().st_mtime_ns
    native.library.cache_clear()
    assert native.library() is not None and so.stat().st_mtime_ns == stamp  # loaded, not built again
    _kernels_agree_with_torch()


@pytest.mark.parametrize("sidecar", ["none", "stale", "planted"])
def test_a_planted_library_never_runs_and_is_rebuilt(cache, good_build, tmp_path, sidecar):
    marker = tmp_path / "planted-ran"
    planted = _planted(tmp_path, marker)
    digest = {"none": None, "stale": good_build[0][".sha256"], "planted": b"0" * 64}[sidecar]
    lib, side = _seed(cache, good_build, so=planted)
    if sidecar == "none":
        side.unlink()
    elif digest is not None:
        side.write_bytes(digest)
    assert native.library() is not None
    assert not marker.exists()  # its constructor never ran
    assert lib.read_bytes() == good_build[0][".so"] and side.read_bytes() == good_build[0][".sha256"]
    _kernels_agree_with_torch()


def test_a_truncated_library_is_rebuilt_not_turned_off(cache, good_build):
    lib, side = _seed(cache, good_build, so=good_build[0][".so"][:5000])
    assert native.library() is not None
    assert lib.read_bytes() == good_build[0][".so"]
    _kernels_agree_with_torch()


def test_a_library_missing_a_kernel_is_rebuilt_without_a_traceback(cache, good_build, tmp_path):
    """Even a library whose sidecar matches (written by this user: out of the threat model) must hold every kernel."""
    marker = tmp_path / "ran"
    incomplete = _planted(tmp_path, marker, missing="best_rows")
    lib, side = _seed(cache, good_build, so=incomplete, digest=hashlib.sha256(incomplete).hexdigest().encode())
    assert native.library() is not None
    assert lib.read_bytes() == good_build[0][".so"]
    _kernels_agree_with_torch()


def test_a_build_missing_a_kernel_leaves_torch_with_one_warning(cache, tmp_path, monkeypatch, capsys):
    script = tmp_path / "cc-drops-best-rows"
    script.write_text('#!/bin/sh\nfor a; do case "$a" in *.c) sed -i "/^KERNEL void best_rows/,\\$d" "$a";; esac; done\n'
                      'exec cc "$@"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    assert native.library() is None and not native.available()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "best_rows" in err[0] and "torch computes every statistic" in err[0]
    assert not GapStats(0.1, 0.0, 10, kernels=True).kernels
    assert not any(cache.glob("*.so"))


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_group_writable_library_or_folder_is_never_loaded(cache, good_build, tmp_path, where):
    marker = tmp_path / "planted-ran"
    planted = _planted(tmp_path, marker)
    lib, side = _seed(cache, good_build, so=planted, digest=hashlib.sha256(planted).hexdigest().encode())
    if where == "file":
        lib.chmod(0o620)
    else:
        cache.chmod(0o770)
    assert native.library() is not None and not marker.exists()
    _kernels_agree_with_torch()
    if where == "file":  # removed and rebuilt, private
        assert lib.read_bytes() == good_build[0][".so"] and stat.S_IMODE(lib.stat().st_mode) == 0o600
    else:  # a folder others can write into is no cache: built elsewhere each run, nothing written there
        assert lib.read_bytes() == planted and sorted(p.name for p in cache.iterdir()) == sorted([lib.name, side.name])


@pytest.mark.parametrize("flag", ["-ffast-math", "-ffp-contract=fast"])
def test_a_compiler_wrapper_adding_flags_changes_the_key_and_its_build_is_refused(cache, tmp_path, monkeypatch, capsys,
                                                                                   flag):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {native.shutil.which("cc")} "$@" {flag}\n')
    wrapper.chmod(0o755)
    plain = native.build_key(os.path.realpath(native.shutil.which("cc")))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CC", raising=False)
    assert native.shutil.which("cc") == str(wrapper)
    assert native.build_key(str(wrapper)) != plain
    assert native.library() is None  # a build with other floating-point semantics is never used
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: compare's C kernels are off")
    assert not any(cache.glob("*.so"))


def _gap_sides(seed: int):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(300, 1000, generator=g) * 3
    r[7, :40] = r[80, :3] = 0.0  # a zero reference: no relative error there, atol alone
    t = r.to(torch.bfloat16).float()
    t[80, :3] = 0.25  # a gap over atol at a zero reference: it fails (torch's path) and no rtol passes it
    t[151, 9] = math.nan  # a non-finite slice: torch's path
    r[230, 5], t[230, 5] = 0.25, 0.35  # a gap a hair under atol (0.099999994): float64's recount, torch's path
    return r, t


@pytest.mark.parametrize("capacity", [300_000, 10**8], ids=["exact", "histogram"])
def test_the_gap_kernel_gives_torchs_counts_maxima_and_quantiles(capacity):
    r, t = _gap_sides(0)
    torch_path, kernel = GapStats(0.1, 0.0, capacity, kernels=False), GapStats(0.1, 0.0, capacity, kernels=True)
    took = 0
    for a in range(0, 300, 25):
        x, y = r[a : a + 25], t[a : a + 25]
        expected = torch_path.update(x, y, group="ordinary")
        got = kernel.update(x, y, group="ordinary")
        took += kernel.last_row_max is not None
        assert torch.equal(got, expected)  # each row's largest gap
    assert took == 9  # the failing slice, the NaN's and the near one went through torch
    a, b = torch_path.result(), kernel.result()
    assert b.failing >= 4 and b.min_passing_rtol == math.inf  # 3 at the zero reference, the NaN
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("mean_abs", "mean_rel"):  # float32 slice sums against float64 ones
            assert y == pytest.approx(x, rel=1e-6), f.name
        else:
            assert y == x, f.name


def _scores(seed: int, shape=(4, 30, 500)):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(*shape, generator=g) * 3
    t = r.to(torch.bfloat16).float()  # bfloat16: ties at the k-th best are common
    rows, tr = r.view(-1, shape[-1]), t.view(-1, shape[-1])  # by row: a case [N, C] or a token [N, T, C]
    rows[3, 7] = rows[3].max() + 1
    tr[3, 7] = math.nan  # a NaN: torch's path
    rows[32], tr[32] = 0.0, 0.0  # every class tied
    tr[65] = rows[65] + 5 * torch.randn(shape[-1], generator=g)  # far apart: KL's direct form
    rows[94, 11] = -math.inf  # a masked class
    return r, t


@pytest.mark.parametrize("tie_rule", ["lowest_index", "tie_is_flip"])
def test_the_decision_kernel_gives_torchs_labels_and_a_kl_at_least_as_close_to_float64(tie_rule):
    r, t = _scores(1)
    (r_lab, r_top, r_lse), (t_lab, t_top, t_lse), kl = decided_pair(r, t, 5, tie_rule)
    er, et = _top(r, 5, tie_rule, True), _top(t, 5, tie_rule, True)
    ekl, elr, elt = kl_and_lse(r, t, ref_argmax=er[1][1][..., 0])
    assert torch.equal(r_lab, er[0]) and torch.equal(t_lab, et[0])
    for got, want in ((r_top, er[1]), (t_top, et[1])):
        assert torch.equal(torch.nan_to_num(got[0], nan=9.0), torch.nan_to_num(want[0], nan=9.0))
        assert torch.equal(got[1].sort(-1).values, want[1].sort(-1).values)  # the same set of classes
    assert torch.equal(torch.isfinite(kl), torch.isfinite(ekl)) and bool(torch.isinf(kl[0, 3]))  # the NaN's row
    finite = torch.isfinite(kl)
    scale = r.abs().amax(-1)[finite] + elr[finite].abs()  # float32 rounding of the scores and of the sum's log
    assert bool(((r_lse - elr)[finite].abs() <= 1e-6 * scale).all())
    assert bool(((t_lse - elt)[finite].abs() <= 1e-6 * scale).all())
    r64, t64 = r.double(), t.double()
    p = torch.softmax(r64, -1)
    exact = torch.where(p > 0, p * (torch.log_softmax(r64, -1) - torch.log_softmax(t64, -1)), 0.0).sum(-1)
    ours, theirs = ((v - exact).abs()[finite] / exact[finite].clamp(min=1e-30) for v in (kl, ekl))
    assert bool((ours <= theirs.clamp(min=1e-6)).all())  # the rows left to torch (masked, far apart) are torch's
    assert float(theirs.max()) > 1e-6  # where float32's e^d - 1 - d loses digits that the series keeps


def test_best_rows_are_best_two_and_labels_and_lse_are_labels_of_and_logsumexp():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 1000, generator=g).half().float()  # float16: ties at the best two
    x[5, 17] = x[5, 900] = x[5].max() + 1  # the maximum twice: the first column, then the second
    values, indices, lse = best_rows(x, 2, True)
    want_v, want_i = best_two(x)
    assert torch.equal(values, want_v) and torch.equal(indices, want_i) and indices[5].tolist() == [17, 900]
    assert torch.allclose(lse, torch.logsumexp(x.double(), -1), rtol=0, atol=2e-6)
    for tie_rule in ("lowest_index", "tie_is_flip"):
        labels, _ = labels_and_lse(x, tie_rule)
        assert torch.equal(labels, labels_of(x, tie_rule))
    x[9, 3] = math.inf
    assert best_rows(x, 2, False) is None and labels_and_lse(x, "lowest_index") == (None, None)


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "classification"])
def test_compare_streams_through_the_kernels_gives_the_same_verdict_statistics(per_token, monkeypatch):
    r, t = _scores(3, (24, 20, 400) if per_token else (3000, 50))
    trained = r + 0.01 * torch.randn(r.shape, generator=torch.Generator().manual_seed(4))
    ids = [f"ordinary/{i}" for i in range(r.shape[0] - 2)] + ["edge/0", "edge/1"]
    g = torch.Generator().manual_seed(5)
    y = torch.randint(0, r.shape[-1], r.shape[:-1], generator=g)
    runs = streams.Trajectories((step(0), step(1, 0.9)), (step(0), step(1, 0.9)), 1.0)

    def compare(min_elements: int):
        monkeypatch.setattr(native, "MIN_ELEMENTS", min_elements)
        sources = streams.Sources(ids, y, torch.ones(len(ids), dtype=torch.bool), streams.InMemory({"logits": r}),
                                  streams.InMemory({"logits": t}), streams.InMemory({"logits": trained}))
        return streams.compare_streams("classification", AcceptanceConfig(), sources, runs)

    (a, table_a), (b, table_b) = compare(1 << 62), compare(0)
    assert a.outputs.kernels is None and b.outputs.kernels is True
    assert b.flips.flips == a.flips.flips and b.flips.near_boundary_flips == a.flips.near_boundary_flips
    assert [(f.id, f.position, f.reference_class, f.trial_class) for f in b.flips.flip_list] == \
        [(f.id, f.position, f.reference_class, f.trial_class) for f in a.flips.flip_list]
    va, vb = a.values["logits"], b.values["logits"]
    assert (vb.failing, vb.max_abs, vb.p99_abs, vb.min_passing_atol) == (va.failing, va.max_abs, va.p99_abs, va.min_passing_atol)
    assert (b.quality.reference, b.quality.trial, b.quality.trained, b.quality.counts) == \
        (a.quality.reference, a.quality.trial, a.quality.trained, a.quality.counts)
    if per_token:
        da, db = a.distribution, b.distribution
        assert (db.tokens, db.top1_agreement, db.top_k_overlap) == (da.tokens, da.top1_agreement, da.top_k_overlap)
        for name, value in da.kl_quantiles.items():
            assert db.kl_quantiles[name] == pytest.approx(value, rel=1e-4), name
        assert db.kl_mean == pytest.approx(da.kl_mean, rel=1e-4)
        for side, value in a.quality.perplexity.items():
            assert b.quality.perplexity[side] == pytest.approx(value, rel=1e-6), side
    assert [row["id"] for row in table_b] == [row["id"] for row in table_a]


def test_a_top_k_beyond_what_the_kernel_keeps_takes_torchs_path():
    """``top_k: 100`` (the metric's k): more best classes than a row's kernel keeps (``native.MAX_K``)."""
    r, t = _scores(6, (3, 40, 300))
    ids, kinds = [f"ordinary/{i}" for i in range(3)], ["ordinary"] * 3
    results = []
    for kernels in (False, True):
        stats = DecisionStats(ids, kinds, "lowest_index", 0.05, "logit", 120, top_k=100, kernels=kernels)
        stats.update(0, r, t)
        results.append((stats.result().flips, stats.distribution().top_k_overlap))
    assert results[0] == results[1] and 100 > native.MAX_K


def _adversarial(c: int = 200):
    """Rows of scores that meet every shortcut of the kernels: NaN, ±inf, ties across the kernel's column groups, -0.0
    against 0.0, 3e38 against -3e38, subnormals, and a gap exactly at the tolerance."""
    g = torch.Generator().manual_seed(11)
    r = torch.randn(24, c, generator=g) * 3
    t = r.to(torch.bfloat16).float()
    r[0, 4] = math.nan
    t[1, 9] = math.nan
    r[2, 3], t[2, 3] = math.inf, math.inf
    t[3, 5] = -math.inf
    r[4, 7] = r[4, 7 + 64] = r[4].max() + 1  # a tie at the best across two groups
    t[4] = r[4]
    r[5, 1] = r[5, 130] = r[5].max() + 1  # the reference tied, the trial not
    t[5, 130] = r[5, 130] + 0.5
    r[6], t[6] = 0.0, -0.0  # -0.0 against 0.0 everywhere
    r[6, 0], t[6, 1] = -0.0, 0.0
    r[7, 2], t[7, 2] = 3e38, -3e38
    r[8, 3], t[8, 4] = -3e38, 3e38
    r[9], t[9] = r[9] * 1e-40, t[9] * 1e-40  # subnormal scores
    r[10, 0], t[10, 0] = 0.25, 0.35  # a gap at atol (0.1 rounds to 0.099999994 here)
    r[11, :64], t[11, :64] = 1.0, 1.0  # 64 tied classes
    t[12] = r[12] + 10 * torch.randn(c, generator=g)  # far apart
    r[13, 0], t[13, 0] = 1.0, 1.0 + 0.1 * (1.0 + 2**-23)  # a gap at atol + the tolerance's relative part
    return r, t


@pytest.mark.parametrize("margin_kind", ["logit", "probability", "relative"])
@pytest.mark.parametrize("per_token", [False, True], ids=["classification", "per_token"])
def test_adversarial_outputs_give_the_same_counts_flips_and_gaps_on_both_paths(margin_kind, per_token):
    r, t = _adversarial()
    _, top, lse = _top(r, 2, "lowest_index", True)
    margin = float(margins(top, margin_kind, lse, r)[12])  # a boundary exactly at a case's own margin
    if per_token:
        r, t = r.view(6, 4, -1), t.view(6, 4, -1)
    ids, kinds = [f"ordinary/{i}" for i in range(r.shape[0])], ["ordinary"] * r.shape[0]
    seen = []
    for kernels in (False, True):
        stats = DecisionStats(ids, kinds, "tie_is_flip", margin, margin_kind, r[..., 0].numel(), kernels=kernels)
        stats.update(0, r, t)
        d = stats.result()
        gaps = GapStats(0.0, 0.1, 10**6, kernels=kernels)
        gaps.update(r, t, group="ordinary")
        v = gaps.result()
        seen.append((d.flips, d.near_boundary_flips, d.near_boundary_cases,
                     [(f.id, f.position, f.reference_class, f.trial_class, f.near_boundary) for f in d.flip_list],
                     v.failing, v.max_abs, v.p99_abs, v.min_passing_atol))
    assert seen[0] == seen[1]
