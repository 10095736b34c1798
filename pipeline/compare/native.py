"""Compare's fused CPU kernels: each statistic's element-wise passes done in one loop over a slice, in plain C.

Why: torch runs each element-wise step of a statistic as its own pass over the slice (the gap, its sum, its
maximum, the tolerance's excess, the relative gap, their maxima, the selection of the values a p99 still needs):
a dozen passes where one loop does all of it. At LLM scale compare would otherwise run at a sixth of the speed
of reading its bytes (``scripts/bench_compare.py``).

How: the C source below is compiled once per machine by the system's C compiler (``cc``, or ``$CC``) into a
cache folder (``$XDG_CACHE_HOME/amp-validation``, keyed by the source's and the compiler's hash) and loaded
with ``ctypes``: no build step at install, no dependency. On x86-64 Linux one build carries AVX-512, AVX2 and
baseline versions of each kernel, the CPU's picked at load (``target_clones``). No fast-math and no contraction
into fused multiply-adds: every float32 operation of a gap rounds as torch's does, so counts, maxima and the
quantiles' values are the same; sums are taken in float64 (torch's slices sum in float32: both within float32
rounding); KL takes e^d - 1 - d from its series near 0, closer to float64 than torch's float32 difference.
- ``gap_slice``: ``gaps.GapStats``' statistics of a slice, and the values its p99s still need (``StreamQuantile.selection``);
- ``decide_rows``: per row, the k best of both sides, both log-sum-exps and KL (``decisions.decided_pair``);
- ``best_rows``: per row, the best few and the log-sum-exp (``decisions.best_rows``: the trained side's labels and NLL).

When: only for outputs of at least ``MIN_ELEMENTS`` (the default small run never compiles anything), on the
CPU, for contiguous float32 sides. Wherever a kernel cannot answer alone (a non-finite element, a slice near
the tolerance, a masked class, a tie at the k-th best, two distributions far apart) it says so and the caller takes
torch's path for that slice or row: the kernels cover the common case and torch stays the definition of every
rare one. Without a compiler (or one that fails), or with ``AMP_COMPARE_KERNELS=off``, torch's path runs throughout
(``available`` says which; ``stats.json`` records ``outputs.kernels`` where they ran).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
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
    """The compiled kernels, or None where no C compiler works (torch's path then runs throughout)."""
    if os.environ.get("AMP_COMPARE_KERNELS", "").lower() in ("0", "off", "torch"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    try:
        path = _compiled(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int if name == "gap_slice" else None
    return lib


FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
"""Portable code (``target_clones``: AVX-512, AVX2 or baseline, picked when loaded), every float32 operation rounded
on its own (no fused multiply-add, no fast-math); ``omp simd`` reductions only reorder float64 sums and maxima."""


def _compiled(compiler: str) -> Path:
    """The shared library for this source and compiler, compiled into the cache folder if it is not there yet."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join((SOURCE, version, *FLAGS)).encode()).hexdigest()[:20]
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "amp-validation"
    path = folder / f"compare-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # compiled beside, renamed into place: never half-written
        src, out = Path(tmp) / "compare.c", Path(tmp) / "compare.so"
        src.write_text(SOURCE)
        subprocess.run([compiler, *FLAGS, "-o", str(out), str(src), "-lm"], check=True, capture_output=True, timeout=300)
        os.replace(out, path)
    return path


def pointer(t: torch.Tensor, kind=F32):
    """A ctypes pointer to a contiguous CPU tensor's first element."""
    return ctypes.cast(t.data_ptr(), kind)
