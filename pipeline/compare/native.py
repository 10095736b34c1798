"""Compare's fused CPU kernels: each statistic's element-wise passes done in one loop over a slice, in plain C.

Why: torch runs each element-wise step of a statistic as its own pass over the slice (the gap, its sum, its
maximum, the tolerance's excess, the relative gap, their maxima, the selection of the values a p99 still needs):
a dozen passes where one loop does all of it. At LLM scale compare would otherwise run at a sixth of the speed
of reading its bytes (``scripts/bench_compare.py``).

How: the C source below is compiled by the system's C compiler (``cc``, or ``$CC``) on first use and loaded with
``ctypes``: no build step at install, no dependency. On x86-64 Linux one build carries AVX-512, AVX2 and
baseline versions of each kernel, the CPU's picked at load (``target_clones``). No fast-math and no contraction
into fused multiply-adds: every float32 operation of a gap rounds as torch's does, so counts, maxima and the
quantiles' values are the same; sums are taken in float64 (torch's slices sum in float32: both within float32
rounding); KL takes e^d - 1 - d from its series near 0, closer to float64 than torch's float32 difference.

- ``gap_slice``: ``gaps.GapStats``' statistics of a slice, and the values its p99s still need (``StreamQuantile.selection``);
- ``decide_rows``: per row, the k best of both sides, both log-sum-exps and KL (``decisions.decided_pair``);
- ``best_rows``: per row, the best few and the log-sum-exp (``decisions.best_rows``: the trained side's labels and NLL).

Safety: the build is kept between runs, and nothing is loaded unverified (``library``):
- the cache (``$XDG_CACHE_HOME/amp-validation``, ~1.3 s of compile saved per run) is used only if it is a folder
  of this user that nobody else can write (created 0700); otherwise each run builds in a private temporary folder;
- its key covers the source, the flags, the compiler's resolved path, its executable's sha256, its ``--version``
  and the macros it predefines under these flags (``cc -dM -E``: a wrapper adding ``-march=native`` or
  ``-ffast-math`` shows there), and the interpreter's and platform's tags;
- a build is written in a private folder (0700) and loaded from there; the library's sha256 goes into a sidecar
  (``compare-KEY.sha256``), both renamed into the cache, the sidecar last;
- a cached library is read once (a regular file of this user, not a link, that nobody else can write), its bytes
  hashed against the sidecar, and those bytes loaded from a private copy: a planted, truncated or stale file, or
  one of another user, is removed and rebuilt, never loaded (its constructor never runs);
- a library is used only if it holds every kernel and gives known answers: a NaN is handed to torch and the
  tolerance's excess rounds as float32 does (``_known_answers``). The source refuses to compile under fast-math's
  macros; a fused multiply-add (``-ffp-contract=fast``, which no macro shows) fails the known answers.
  A build that fails any of these is not used: one warning line on stderr, and torch's path (this run only).
Threat model: other users (a shared or group-writable cache), a corrupted or half-written cache, a stale build of
another compiler or other flags, and a compiler wrapper that adds flags. Out of reach: anyone who can write files as
this user (they could as well edit this module or torch, so the sidecar is not signed), a wrapper whose output
changes between runs while its path, digest, version and macros do not (the known answers catch flags that
change rounding, not every one), and the compiler itself. Building afresh in every run would not shut out that
writer either, and would add ~1.3 s where a 16.8 M-element compare takes ~0.1 s.

When: only for outputs of at least ``MIN_ELEMENTS`` (the default small run never compiles anything), on the
CPU, for contiguous float32 sides. Wherever a kernel cannot answer alone (a non-finite element, a slice near
the tolerance, a masked class, a tie at the k-th best, two distributions far apart) it says so and the caller takes
torch's path for that slice or row: the kernels cover the common case and torch stays the definition of every
rare one. Without a compiler (or one that fails), or with ``AMP_COMPARE_KERNELS=off``, torch's path runs throughout
(``available`` says which; ``stats.json`` records ``outputs.kernels`` where they ran).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

MIN_ELEMENTS = 1 << 24
"""Fewest elements of one output for which its statistics go through the kernels (16.8 M: a 1,000-class
classifier over 16,800 cases; the shipped examples hold at most a few hundred thousand)."""

MAX_K = 62
"""Most best classes a row's kernel keeps (``top_k`` of the metric; the C source's ``GROUPS`` - 2)."""

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* A compiler (or a wrapper around it) that adds fast-math would change counts and quantiles: refuse to build. */
#if defined(__FAST_MATH__) || __FINITE_MATH_ONLY__ || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__) \
    || defined(__NO_SIGNED_ZEROS__)
#error "compare's kernels need IEEE float semantics: build without -ffast-math and its parts"
#endif

#if defined(__x86_64__) && defined(__linux__)  /* one build, the widest vectors the CPU has, picked at load (ifunc) */
#define KERNEL __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KERNEL
#endif

/* Copy the values of v[0:len] above floor (incl: at or above it) to out, in order; return how many.
   Groups of 16 whose largest is not above the floor are skipped (most are: a p99 keeps a hundredth of them). */
static int64_t keep_scalar(const float *v, int64_t len, float floor, int incl, float *out)
{
    int64_t k = 0, j = 0;
    for (; j + 16 <= len; j += 16) {
        float top = v[j];
        for (int u = 1; u < 16; u++) top = v[j + u] > top ? v[j + u] : top;
        if (incl ? !(top >= floor) : !(top > floor)) continue;
        for (int u = 0; u < 16; u++) if (incl ? v[j + u] >= floor : v[j + u] > floor) out[k++] = v[j + u];
    }
    for (; j < len; j++) if (incl ? v[j] >= floor : v[j] > floor) out[k++] = v[j];
    return k;
}

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx512f"))) static int64_t keep_avx512(const float *v, int64_t len, float floor, int incl, float *out)
{
    int64_t k = 0, j = 0;
    __m512 f = _mm512_set1_ps(floor);
    for (; j + 16 <= len; j += 16) {  /* ordered comparisons: a NaN is never kept */
        __m512 x = _mm512_loadu_ps(v + j);
        __mmask16 m = incl ? _mm512_cmp_ps_mask(x, f, _CMP_GE_OQ) : _mm512_cmp_ps_mask(x, f, _CMP_GT_OQ);
        if (m) {
            _mm512_mask_compressstoreu_ps(out + k, m, x);
            k += __builtin_popcount(m);
        }
    }
    return k + keep_scalar(v + j, len - j, floor, incl, out + k);
}
#endif

static int64_t keep(const float *v, int64_t len, float floor, int incl, float *out)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f")) return keep_avx512(v, len, floor, incl, out);
#endif
    return keep_scalar(v, len, floor, incl, out);
}

#define BLOCK 512

/* The gap statistics of one slice of float32 pairs, rows of `width` elements (see gaps.GapStats).
   Returns 0, or 1 when the slice holds a non-finite element or gap: torch's path then takes it whole.
   gap_out (or NULL): |t - r|; row_max: each row's largest gap.
   out_f: [max gap, max (gap - rtol |r|), max rel over |r| > 0, max (gap - atol) / |r| over |r| > 0];
   out_d: [sum gap, sum rel over |r| > 0];
   out_n: [abs values kept, rel values kept, elements with |r| == 0] (one there with gap > atol fails: torch's).
   A value is kept (copied to abs_kept, rel_kept) where it is above the floor, or at or above it (incl). */
KERNEL int gap_slice(const float *r, const float *t, int64_t n, int64_t width, float rtol, float atol,
                     float abs_floor, int abs_incl, float rel_floor, int rel_incl,
                     float *gap_out, float *row_max, float *abs_kept, float *rel_kept,
                     float *out_f, double *out_d, int64_t *out_n)
{
    float mx = 0.0f, worst = -INFINITY, rmax = 0.0f, need = -INFINITY;
    double sum_gap = 0.0, sum_rel = 0.0;
    int64_t zero = 0, ka = 0, kr = 0;
    int64_t rows = width > 0 ? n / width : 0;
    float gb[BLOCK], qb[BLOCK];
    for (int64_t i = 0; i < rows; i++) {
        float rowmx = 0.0f;
        for (int64_t s = 0; s < width; s += BLOCK) {
            const float *ri = r + i * width + s, *ti = t + i * width + s;
            int64_t len = width - s < BLOCK ? width - s : BLOCK;
            double sg = 0.0, sr = 0.0;
            int64_t z_n = 0;
            #pragma omp simd reduction(+:sg, sr, z_n) reduction(max:rowmx, worst, rmax, need)
            for (int64_t j = 0; j < len; j++) {
                float a = ri[j], b = ti[j];
                float g = fabsf(b - a), m = fabsf(a);
                float e = g - rtol * m;
                int z = m == 0.0f;
                float q = g / m, u = (g - atol) / m;
                gb[j] = g;
                qb[j] = z ? NAN : q;
                sg += g;
                sr += z ? 0.0 : (double)q;
                z_n += z;
                rowmx = g > rowmx ? g : rowmx;
                worst = e > worst ? e : worst;
                rmax = (!z && q > rmax) ? q : rmax;
                need = (!z && u > need) ? u : need;
            }
            if (!(sg < INFINITY)) return 1;  /* a NaN or an infinity on either side: torch's path */
            if (gap_out) for (int64_t j = 0; j < len; j++) gap_out[i * width + s + j] = gb[j];
            ka += keep(gb, len, abs_floor, abs_incl, abs_kept + ka);  /* the few values a quantile still needs */
            kr += keep(qb, len, rel_floor, rel_incl, rel_kept + kr);
            sum_gap += sg;
            sum_rel += sr;
            zero += z_n;
        }
        row_max[i] = rowmx;
        mx = rowmx > mx ? rowmx : mx;
    }
    out_f[0] = mx; out_f[1] = worst; out_f[2] = rmax; out_f[3] = need;
    out_d[0] = sum_gap; out_d[1] = sum_rel;
    out_n[0] = ka; out_n[1] = kr; out_n[2] = zero;
    return 0;
}

/* e^x in float32 for x <= 88.7 (Cephes' expf: x = n ln 2 + f, |f| <= ln 2 / 2, a degree-6 polynomial, within
   2 ulp), 0 below -87.3 (where float32 turns subnormal), branch-free so that loops over it vectorize. */
static inline __attribute__((always_inline)) float exp_f(float x)
{
    float xc = x < -87.3f ? -87.3f : x;
    float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    float f = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return x < -87.3f ? 0.0f : p * scale.f;
}

/* e^d - 1 - d for |d| < 0.5, from its series (no cancellation: d^2 / 2 (1 + d / 3 + ...), truncated at d^10 / 10!). */
static inline __attribute__((always_inline)) float series_expm1_minus(float d)
{
    float s = 1.0f / 362880;
    s = s * d + 1.0f / 40320;
    s = s * d + 1.0f / 5040;
    s = s * d + 1.0f / 720;
    s = s * d + 1.0f / 120;
    s = s * d + 1.0f / 24;
    s = s * d + 1.0f / 6;
    s = s * d + 0.5f;
    return s * d * d;
}

/* e^d - 1 - d: the series near 0, e^d - 1 - d beyond |d| = 0.5 (where no cancellation is left to fear). */
static inline __attribute__((always_inline)) float expm1_minus(float d)
{
    float near = series_expm1_minus(d), far = (exp_f(d) - 1.0f) - d;
    return (d < 0.5f && d > -0.5f) ? near : far;
}

/* Insert x (column j) among the best kept of a row (vals descending, equal values by lowest column), n kept of
   at most cap: the caller has checked that x comes before the last kept when the row is full. */
static inline void insert_best(float x, int64_t j, float *vals, int64_t *cols, int *n, int cap)
{
    int at = *n < cap ? *n : cap - 1;
    while (at > 0 && (x > vals[at - 1] || (x == vals[at - 1] && j < cols[at - 1]))) {
        vals[at] = vals[at - 1];
        cols[at] = cols[at - 1];
        at--;
    }
    vals[at] = x;
    cols[at] = j;
    if (*n < cap) (*n)++;
}

#define GROUPS 64

/* The cap best of one row of c scores (cap <= c, cap < GROUPS): vals descending, equal values by lowest column.
   Returns whether every score is finite (else vals and cols are of no use). Column j is in group j % GROUPS; one
   vectorized pass takes each group's maximum (element-wise maxima of consecutive GROUPS columns); the cap best scores
   lie in the groups whose maximum is at or above the cap-th best of those maxima (a group holding one of them has its
   maximum at or above the cap-th best score), so only those few groups are scanned score by score. */
static inline __attribute__((always_inline)) int best_of(const float *x, int64_t c, int cap, float *vals, int64_t *cols)
{
    float gmax[GROUPS];
    int bad[GROUPS];
    for (int u = 0; u < GROUPS; u++) { gmax[u] = -INFINITY; bad[u] = 0; }
    int64_t full = c / GROUPS * GROUPS;
    for (int64_t j = 0; j < full; j += GROUPS) {
        #pragma omp simd
        for (int u = 0; u < GROUPS; u++) {
            float v = x[j + u];
            gmax[u] = v > gmax[u] ? v : gmax[u];
            bad[u] |= !((v - v) == 0.0f);
        }
    }
    for (int64_t j = full; j < c; j++) {
        float v = x[j];
        gmax[j - full] = v > gmax[j - full] ? v : gmax[j - full];
        bad[j - full] |= !((v - v) == 0.0f);
    }
    int any_bad = 0;
    for (int u = 0; u < GROUPS; u++) any_bad |= bad[u];
    if (any_bad) return 0;
    float best[GROUPS];
    int64_t group[GROUPS];
    int m = 0, n = 0;
    for (int u = 0; u < GROUPS && u < c; u++)
        if (m < cap || gmax[u] > best[cap - 1]) insert_best(gmax[u], u, best, group, &m, cap);
    float floor = best[m - 1];
    for (int u = 0; u < GROUPS && u < c; u++) {
        if (gmax[u] < floor) continue;
        for (int64_t j = u; j < c; j += GROUPS)
            if (n < cap || x[j] > vals[cap - 1] || (x[j] == vals[cap - 1] && j < cols[cap - 1]))
                insert_best(x[j], j, vals, cols, &n, cap);
    }
    return 1;
}

/* Per row (a case, or a token) of float32 scores r and t [rows, c], c > k, k + 1 < GROUPS: the k + 1 best of each side (values
   descending, columns; equal values by lowest column), both log-sum-exps and KL(softmax(r) || softmax(t)) in
   float64, the latter by decisions.kl_and_lse's cancellation-free form: with e = e^(r - max r), S = sum e,
   d = t - r, h = e^d - 1 - d: A = sum e (d + h) / S, KL = sum e h / S - (A - log1p A), lse(t) = lse(r) + log1p A.
   flag[i]: 1 where the row needs torch's path throughout (a non-finite score; A > 1 or a non-finite piece: the direct
   form, far apart), else 2 and 4 where the k-th and (k + 1)-th best of the reference, of the trial, are equal (which
   of them topk keeps is its own: its k best are taken there), else 0. */
KERNEL void decide_rows(const float *r, const float *t, int64_t rows, int64_t c, int k,
                        float *rv, int64_t *ri, float *tv, int64_t *ti,
                        double *lse_r, double *lse_t, double *kl, uint8_t *flag)
{
    int cap = k + 1;
    for (int64_t i = 0; i < rows; i++) {
        const float *x = r + i * c, *y = t + i * c;
        float *xv = rv + i * cap, *yv = tv + i * cap;
        flag[i] = 1;
        if (!best_of(x, c, cap, xv, ri + i * cap) || !best_of(y, c, cap, yv, ti + i * cap)) continue;
        int ties = (xv[k - 1] == xv[k] ? 2 : 0) | (yv[k - 1] == yv[k] ? 4 : 0);
        float top = xv[0], far = 0.0f;
        double sum = 0.0, sa = 0.0, sp = 0.0;
        #pragma omp simd reduction(+:sum, sa, sp) reduction(max:far)
        for (int64_t j = 0; j < c; j++) {
            float e = exp_f(x[j] - top), d = y[j] - x[j];
            float h = series_expm1_minus(d);
            sum += e;
            sa += e * (d + h);
            sp += e * h;
            far = fabsf(d) > far ? fabsf(d) : far;
        }
        if (far >= 0.5f) {  /* some |d| beyond the series' range: the row again, each term by its own form */
            sa = sp = 0.0;
            #pragma omp simd reduction(+:sa, sp)
            for (int64_t j = 0; j < c; j++) {
                float e = exp_f(x[j] - top), d = y[j] - x[j];
                float h = expm1_minus(d);
                sa += e * (d + h);
                sp += e * h;
            }
        }
        double a = sa / sum, pos = sp / sum;
        if (!(a <= 1.0) || !(pos < INFINITY)) continue;
        double lr = top + log(sum);
        lse_r[i] = lr;
        lse_t[i] = lr + log1p(a);
        double value = pos - (a - log1p(a));
        kl[i] = value > 0.0 ? value : 0.0;
        flag[i] = ties;
    }
}

/* Per row of float32 scores x [rows, c >= cap], cap < GROUPS: its cap best (vals descending, cols; equal values by lowest column,
   so the first is the first column of the maximum) and, where lse is not NULL, the log-sum-exp in float64.
   flag[i]: 1 where a score is not finite (torch's path), else 0. */
KERNEL void best_rows(const float *x, int64_t rows, int64_t c, int cap, float *vals, int64_t *cols, double *lse,
                      uint8_t *flag)
{
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * c;
        flag[i] = 1;
        if (!best_of(xi, c, cap, vals + i * cap, cols + i * cap)) continue;
        if (lse) {
            float top = vals[i * cap];
            double sum = 0.0;
            #pragma omp simd reduction(+:sum)
            for (int64_t j = 0; j < c; j++) sum += exp_f(xi[j] - top);
            lse[i] = top + log(sum);
        }
        flag[i] = 0;
    }
}
"""

F32 = ctypes.POINTER(ctypes.c_float)
F64 = ctypes.POINTER(ctypes.c_double)
I64 = ctypes.POINTER(ctypes.c_int64)
U8 = ctypes.POINTER(ctypes.c_uint8)
_SIGNATURES = {
    "best_rows": [F32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, F32, I64, F64, U8],
    "decide_rows": [F32, F32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, F32, I64, F32, I64, F64, F64, F64, U8],
    "gap_slice": [F32, F32, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_float,
                  ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                  F32, F32, F32, F32, F32, F64, I64],
}


def wanted(elements: int, device: torch.device | str | None = None) -> bool:
    """Whether an output of ``elements`` elements computed on ``device`` goes through the kernels (and they load)."""
    return elements >= MIN_ELEMENTS and torch.device(device or "cpu").type == "cpu" and available()


def available() -> bool:
    """Whether the kernels are compiled and loaded on this machine (compiling them the first time)."""
    return library() is not None


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, verified, or None (torch's path then runs throughout): with ``AMP_COMPARE_KERNELS=off``,
    without a C compiler, or where no build verifies (one warning line on stderr says why)."""
    if os.environ.get("AMP_COMPARE_KERNELS", "").lower() in ("0", "off", "torch"):
        return None
    named = os.environ.get("CC") or "cc"
    compiler = shutil.which(named) or (shutil.which("gcc") if not os.environ.get("CC") else None)
    if not compiler:
        return None
    try:
        return _load(os.path.realpath(compiler))
    except (OSError, subprocess.SubprocessError, _Unverified) as exc:
        lines = (getattr(exc, "stderr", None) or str(exc) or type(exc).__name__).strip().splitlines() or ["failed"]
        detail = next((line for line in lines if "error" in line), lines[-1])
        print(f"warning: compare's C kernels are off ({named}: {detail[:200]}); torch computes every statistic",
              file=sys.stderr)
        return None


FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
"""Portable code (``target_clones``: AVX-512, AVX2 or baseline, picked when loaded), every float32 operation rounded
on its own (no fused multiply-add, no fast-math); ``omp simd`` reductions only reorder float64 sums and maxima."""


class _Unverified(Exception):
    """A library that must not be (or was not) loaded: the cache's copy is removed and rebuilt, a fresh build refused."""


def cache_folder() -> Path:
    """Where verified builds are kept between runs: ``$XDG_CACHE_HOME/amp-validation`` (``~/.cache`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "amp-validation"


def build_key(compiler: str) -> str:
    """The cache key of a build by ``compiler`` (a resolved path): the source, the flags, the compiler's path, the
    digest of its executable, its ``--version``, the macros it predefines under these flags (``-dM -E``: what a
    wrapper's extra flags such as ``-march`` or ``-ffast-math`` turn on), and the interpreter and platform."""
    def run(*args: str) -> str:
        return subprocess.run([compiler, *args], capture_output=True, text=True, timeout=60, check=True).stdout
    parts = (SOURCE, *FLAGS, compiler, hashlib.sha256(Path(compiler).read_bytes()).hexdigest(), run("--version"),
             run(*FLAGS, "-dM", "-E", "-x", "c", os.devnull), sys.implementation.cache_tag or "", sysconfig.get_platform())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _load(compiler: str) -> ctypes.CDLL:
    """The cached build for this key if it verifies, else a fresh build (then kept in the cache for the next run)."""
    key = build_key(compiler)
    folder = cache_folder()
    path, digest_path = folder / f"compare-{key}.so", folder / f"compare-{key}.sha256"
    cache = _private_folder(folder)
    if cache and (path.exists() or digest_path.exists()):
        try:
            data = _read_owned(path)
            if hashlib.sha256(data).hexdigest() != _read_owned(digest_path).decode(errors="replace").strip():
                raise _Unverified(f"{path} does not match the digest recorded at its build")
            with tempfile.TemporaryDirectory(prefix="amp-compare-") as tmp:  # the bytes hashed are the bytes loaded
                private = Path(tmp) / "compare.so"
                private.write_bytes(data)
                return _open(private)
        except (OSError, _Unverified):  # planted, truncated, incomplete, another's or stale: never loaded, rebuilt
            for p in (path, digest_path):
                with contextlib.suppress(OSError):
                    p.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=folder if cache else None, prefix="build-") as tmp:  # mode 0700
        src, out = Path(tmp) / "compare.c", Path(tmp) / "compare.so"
        src.write_text(SOURCE)
        subprocess.run([compiler, *FLAGS, "-o", str(out), str(src), "-lm"], check=True, capture_output=True, text=True,
                       timeout=300)
        out.chmod(0o600)
        digest = hashlib.sha256(_read_owned(out)).hexdigest()
        lib = _open(out)  # loaded from the private folder it was built in
        if cache:  # kept for the next run: the library, then its digest (a reader between the two rebuilds)
            os.replace(out, path)
            side = Path(tmp) / "compare.sha256"
            side.write_text(digest + "\n")
            side.chmod(0o600)
            os.replace(side, digest_path)
    return lib


def _private_folder(folder: Path) -> bool:
    """Whether ``folder`` (created 0700 if missing) is a directory of this user that nobody else can write into: the
    cache is used only then (else every run builds in a private temporary folder)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _read_owned(path: Path) -> bytes:
    """The bytes of ``path``, a regular file (not a link) of this user that nobody else can write, or ``_Unverified``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise _Unverified(f"{path} is not a regular file of this user that only this user can write")
        return f.read()


def _open(path: Path) -> ctypes.CDLL:
    """The library at ``path`` (in a private folder), with every kernel's signature, or ``_Unverified``."""
    lib = ctypes.CDLL(str(path))
    missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
    if missing:
        raise _Unverified(f"{path.name} lacks {', '.join(missing)}")
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int if name == "gap_slice" else None
    _known_answers(lib)
    return lib


_KNOWN = ((0.37719064950942993, 0.5277511477470398, 0.11284142732620239),
          (-3.796264410018921, -5.189882278442383, 1.013991355895996),
          (0.12397793680429459, 0.18084976077079773, 0.044474028050899506),
          (-3.7377328872680664, -5.109694004058838, 0.998187780380249))
"""(reference, trial, |t - r| - 0.1 |r|) in float32, each operation rounded on its own: a build that fuses the multiply
and the subtraction (``-ffp-contract=fast``, which no predefined macro shows) gives another last bit for each."""


def _known_answers(lib: ctypes.CDLL) -> None:
    """``gap_slice`` on a few pairs: a NaN must hand the slice to torch, and the tolerance's excess must be rounded as
    torch rounds it (a build with other floating-point flags fails here and is never used)."""
    p = pointer
    out_f, out_d, out_n = torch.empty(4), torch.empty(2, dtype=torch.float64), torch.empty(3, dtype=torch.int64)
    row_max, kept = torch.empty(1), torch.empty(16)
    for ref, trial, excess in (*_KNOWN, (1.0, math.nan, None)):
        r, t = torch.ones(16), torch.ones(16)
        r[3], t[3] = ref, trial
        handed = lib.gap_slice(p(r), p(t), 16, 16, 0.1, 0.0, math.inf, 0, math.inf, 0, None, p(row_max), p(kept), p(kept),
                               p(out_f), p(out_d, F64), p(out_n, I64))
        if handed != (excess is None) or (excess is not None and float(out_f[1]) != excess):
            raise _Unverified("its floating-point results differ from IEEE float32's (a compiler flag such as "
                              "-ffp-contract=fast or -ffast-math?)")


def pointer(t: torch.Tensor, kind=F32):
    """A ctypes pointer to a contiguous CPU tensor's first element."""
    return ctypes.cast(t.data_ptr(), kind)
