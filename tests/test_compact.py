"""The compact store of per-token scores against full float64 arithmetic: decisions exact, KL within its stated bound."""

import math

import numpy as np
import pytest
import torch

from pipeline.artifacts import compact, outputs
from pipeline.compare import streams
from pipeline.compare.decisions import KL_QUANTILES, kl_bound
from pipeline.compare.quantiles import quantile
from pipeline.config import AcceptanceConfig, CompareConfig
from _steps import step

STEPS = tuple(step(i, 1.0 / (i + 1), scale=2.0**16) for i in range(4))
RUNS = streams.Trajectories(STEPS, STEPS, 2.0**16)
V = 1000


def _realistic(n=24, t=16, seed=0):
    """LM-like scores: a spread of about 3 nats with a few peaked rows, and a trial as bfloat16 rounds it."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, t, V, generator=g) * 3 + torch.randn(n, t, 1, generator=g)
    ref[:, :, :8] += torch.rand(n, t, 1, generator=g) * 12  # a few likely tokens per position
    trial = ref.to(torch.bfloat16).float() + torch.randn(n, t, V, generator=g) * 0.02
    return ref, trial


def _adversarial(seed=1):
    """Near-ties (top two 1 ulp and exactly equal), very peaked (scale 100) and very flat rows (scale 1e-4, all
    equal), masked (-inf) entries, and trials that flip exactly the near-tied tokens."""
    ref, trial = _realistic(n=12, t=8, seed=seed)
    ref[0, :, 1] = ref[0, :, 0].max() + 1.0
    ref[0, :, 2] = torch.nextafter(ref[0, :, 1], torch.tensor(-math.inf))  # top two 1 ulp apart
    trial[0] = ref[0]
    trial[0, :4, 2] = ref[0, :4, 1] + 1e-3  # the near tie flips on half the positions
    ref[1, :, 5] = ref[1].amax(-1) + 2.0
    ref[1, :, 9] = ref[1, :, 5]  # an exact tie at the top
    trial[1] = ref[1]
    ref[2] *= 100.0  # very peaked: a range of thousands of nats
    trial[2] = ref[2] * (1 + 1e-3)
    ref[3] *= 1e-4  # very flat
    trial[3] = ref[3] + 1e-5
    ref[4] = 0.0  # flat exactly: every class tied
    trial[4] = 0.0
    trial[4, :2, 7] = 1e-3
    ref[5, :, 500:] = -math.inf  # a masked vocabulary, on both sides
    trial[5, :, 500:] = -math.inf
    return ref, trial


def _exact_kl(ref: torch.Tensor, trial: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(trial)) per token, in float64 from the original float32 scores."""
    r, t = torch.log_softmax(ref.double(), -1), torch.log_softmax(trial.double(), -1)
    p = r.exp()
    return torch.where(p > 0, p * (r - t), torch.zeros_like(p)).sum(-1).clamp(min=0)


def _compare(tmp_path, ref, trial, store, rule):
    n, t, _ = ref.shape
    ids = [f"ordinary/{i}" for i in range(n)]
    targets = ref.argmax(-1)
    targets[:, -1] = -100
    readers = {}
    for side, x in (("reference", ref), ("trial", trial)):
        path = tmp_path / f"{side}-{store}.safetensors"
        outputs.write_outputs(path, [{"logits": x[: n // 2]}, {"logits": x[n // 2 :]}], ids, store=store)
        readers[side] = outputs.OutputsReader(path)
    sources = streams.Sources(ids, targets, torch.ones(n, dtype=torch.bool), readers["reference"], readers["trial"],
                              readers["trial"])
    return streams.compare_streams("classification", rule, sources, RUNS, cfg=CompareConfig(chunk_elements=50_000))[0]


@pytest.mark.parametrize("case", ["realistic", "adversarial"])
@pytest.mark.parametrize("margin_kind", ["logit", "probability"])
def test_compact_store_keeps_decisions_exact_and_kl_within_its_bound(tmp_path, case, margin_kind):
    ref, trial = _realistic() if case == "realistic" else _adversarial()
    rule = AcceptanceConfig(boundary_margin=0.5 if margin_kind == "logit" else 0.02, boundary_margin_kind=margin_kind)
    full = _compare(tmp_path, ref, trial, "full", rule)
    small = _compare(tmp_path, ref, trial, "compact", rule)
    assert full.distribution.store == {"reference": "full", "trial": "full"} and full.distribution.kl_mean_bound == 0.0
    assert small.distribution.store == {"reference": "compact", "trial": "compact"}

    # decisions: exact (the maximum, its ties and the top-2 gap are stored exactly)
    for key in ("cases", "flips", "near_boundary_flips", "near_boundary_cases", "real_flips"):
        assert getattr(small.flips, key) == getattr(full.flips, key), key
    assert small.distribution.top1_agreement == full.distribution.top1_agreement
    assert [f.label for f in small.flips.flip_list] == [f.label for f in full.flips.flip_list]
    if margin_kind == "logit":
        assert [f.reference_margin for f in small.flips.flip_list] == [f.reference_margin for f in full.flips.flip_list]
    if case == "adversarial":
        assert full.flips.real_flips >= 4  # the near ties did flip

    # KL: every statistic within the bound the record states, against float64 on the original scores
    d, exact = small.distribution, _exact_kl(ref, trial)[:, :-1].flatten()  # the last position has no target
    alpha = 2 * d.logit_error
    assert 0 < d.kl_mean_bound <= kl_bound(d.kl_mean, alpha, alpha)  # each side's own error, at most the larger
    assert abs(d.kl_mean - float(exact.mean())) <= d.kl_mean_bound
    for name, q in {**KL_QUANTILES, "max": 1.0}.items():
        stored, true = d.kl_quantiles[name], quantile(exact, q)
        assert true <= stored + kl_bound(stored, alpha, alpha) and stored <= true + kl_bound(true, alpha, alpha), name
    assert abs(full.distribution.kl_mean - float(exact.mean())) <= 1e-6 * max(float(exact.mean()), 1e-3)
    assert small.values["logits"].failing >= full.values["logits"].failing  # the gap's tolerance: conservative side
    if case == "realistic":  # llama.cpp's figure of merit: at most 1e-4 nats on the mean at a realistic spread
        assert d.kl_mean_bound <= 1e-4 and d.logit_error <= 1e-3


def test_decoded_scores_are_within_the_stated_error_and_special_values_exact():
    ref, _ = _adversarial()
    z = ref.numpy().copy()
    z[6, 0, 3], z[6, 1, 4], z[6, 2, 5] = np.nan, np.inf, -np.inf
    parts = compact.encode(z)
    back = compact.decode(parts)
    finite = np.isfinite(z)
    assert np.array_equal(np.isnan(back), np.isnan(z)) and np.array_equal(back[np.isinf(z)], z[np.isinf(z)])
    with np.errstate(invalid="ignore"):  # inf - inf where the special values are: masked out
        rows = np.abs(np.where(finite, back - z, 0)).max(-1)
    top, step = parts["top"], parts["step"]
    assert (rows <= np.vectorize(lambda a, b: compact.logit_error(np.array([a]), np.array([b])))(top, step)).all()
    assert np.array_equal(back.max(-1, initial=-np.inf, where=finite), z.max(-1, initial=-np.inf, where=finite))
    assert np.array_equal(back[4], z[4])  # every class tied: exact


def test_a_rows_codes_do_not_depend_on_a_non_finite_neighbour():
    """Blocks of finite scores take a shorter path than blocks holding a NaN or an infinity: the same codes, bit for bit,
    and the same decoded scores, for rows with ties of the top, many ties, a flat row, tiny and huge spreads."""
    g = np.random.default_rng(3)
    z = (g.standard_normal((3, 40, 300)) * g.choice([1e-6, 1.0, 30.0, 1e30], size=(3, 40, 1))).astype(np.float32)
    z[0, 1, 7] = z[0, 1].max()  # a tie of the top
    z[1] = np.round(g.standard_normal((40, 300)) * 5)  # many ties
    for flat in (False, True):
        finite = z.copy()
        if flat:
            finite[2, 5] = 1.5  # equal scores: no step
        spoiled = finite.copy()
        spoiled[2, 39, 0] = np.nan  # the same block (every row here fits one), one element not finite
        a, b = compact.encode(finite), compact.encode(spoiled)
        keep = (slice(None), slice(0, 39))
        for name in compact.PARTS:
            assert np.array_equal(a[name][keep], b[name][keep]), name
        assert np.array_equal(compact.decode(a)[keep].view(np.uint32), compact.decode(b)[keep].view(np.uint32))


def test_auto_compacts_only_above_its_size_and_full_bytes_are_unchanged(tmp_path):
    ref, _ = _realistic(n=2, t=4)
    a = outputs.write_outputs(tmp_path / "a.safetensors", [{"logits": ref}], ["x", "y"])
    b = outputs.write_outputs(tmp_path / "b.safetensors", [{"logits": ref}], ["x", "y"], store="auto")
    assert a == b  # a small source stays full, byte for byte
    assert compact.chosen("auto", {"logits": (512, 64, 32_000)}, {"logits": "float32"}) == ["logits"]
    assert compact.chosen("compact", {"logits": (2, 4, V)}, {"logits": "float16"}) == []  # already 2 bytes, exactly
    c = outputs.write_outputs(tmp_path / "c.safetensors", [{"logits": ref, "value": ref[:, 0, :1]}], ["x", "y"],
                              store="compact")
    reader = outputs.OutputsReader(tmp_path / "c.safetensors", c)
    assert reader.names == ["logits", "value"] and reader.store == "compact" and reader.shape("logits") == (2, 4, V)
    assert torch.equal(reader.read("value"), ref[:, 0, :1])
    numpy = outputs.NumpyReader(tmp_path / "c.safetensors", c, "freeze")
    assert numpy.elements_per_case == 4 * V + 1
    assert np.array_equal(numpy.read(np.array([1]))["logits"], reader.read("logits", 1, 2).numpy())
    assert (tmp_path / "c.safetensors").stat().st_size < 0.55 * (tmp_path / "a.safetensors").stat().st_size
