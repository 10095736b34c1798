"""params.yaml loads into the typed config once; mistakes are named; the rule hash is canonical."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline import config, paths
from pipeline.config import load_params
from pipeline.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def load(tmp_path, text):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return config.load_params(p)


def test_shipped_params_load_and_every_section_is_present():
    params = config.load_params(ROOT / "params.yaml")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert set(raw) == {f.name for f in config.dataclasses.fields(config.Params)}
    assert params.trial.variants == ["float16", "bfloat16"]
    assert params.acceptance.tolerance("anything").atol == 0.05


def test_empty_file_gives_defaults(tmp_path):
    assert load(tmp_path, "") == config.Params()


@pytest.mark.parametrize(
    "text,words",
    [
        ("acceptance: {outputs: {'*': {atol: -1, rtol: 0}}}", ["acceptance.outputs.*.atol", "0 or more"]),
        ("trial: {variants: [fp8]}", ["trial.variants", "'fp8'", "trial.policies.fp8"]),
        ("task: {model: digits}", ["task.model", "module:function"]),
        ("reference: {train_steps: 1.5}", ["reference.train_steps", "integer"]),
        ("reference: {eval_mode: 'yes'}", ["reference.eval_mode", "true or false"]),
        ("bench: {repeats: 0}", ["bench.repeats", "greater than 0"]),
        ("reference: {lr_schedule: {kind: exponential}}", ["reference.lr_schedule.kind", "'none', 'step', 'cosine', 'linear'"]),
        ("acceptance: {loss_atol: .nan}", ["acceptance.loss_atol", "finite"]),
        # A relative tolerance of 1 cannot fail: |t - r| <= |r| passes a trial of 0, or of twice the reference.
        ("acceptance: {outputs: {'*': {atol: 0.01, rtol: 1}}}", ["acceptance.outputs.*.rtol", "below 1", "twice"]),
        ("acceptance: {loss_rtol: 1.5}", ["acceptance.loss_rtol", "below 1", "twice FP32's"]),
        ("acceptance: {min_amp_share: 10}", ["acceptance.min_amp_share", "a fraction between 0 and 1"]),
        ("device: tpu", ["device", "'auto', 'cpu', 'cuda'"]),
        ("task: [1, 2]", ["task must be a mapping"]),
        ("trial: {variants: [float16, float16]}", ["twice"]),
        # decide@bench-float16 would write data/metrics/bench-float16.json, benchmark@float16's own file
        ("trial: {variants: [float16, bench-float16], policies: {float16: {dtype: float16}, bench-float16: {dtype: float16}}}",
         ["trial.policies name 'bench-float16'", "benchmark@float16", "without the bench- prefix"]),
        ("trial: {variants: [compare-x], policies: {compare-x: {dtype: bfloat16}}}",
         ["compare@x", "data/metrics/compare-x.json"]),
        # data_order: swapped is FP32's A/A: another change beside it could not be told from the data order's
        ("trial: {variants: [s], policies: {s: {dtype: bfloat16, data_order: swapped}}}",
         ["trial.policies.s.data_order 'swapped'", "dtype: float32, compile: off and float8: off"]),
        ("trial: {variants: [s], policies: {s: {compile: inductor, data_order: swapped}}}", ["trial.policies.s.data_order"]),
        ("trial: {variants: [s], policies: {s: {float8: tensorwise, data_order: swapped}}}", ["trial.policies.s.data_order"]),
        ("trial: {variants: [s], policies: {s: {data_order: shuffled}}}", ["trial.policies.s.data_order", "'swapped'"]),
    ],
)
def test_mistakes_name_the_key_and_the_fix(tmp_path, text, words):
    with pytest.raises(UserError) as err:
        load(tmp_path, text)
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, (w, message)


def test_unknown_key_lists_the_known_ones(tmp_path):
    with pytest.raises(UserError, match=r"unknown key 'acceptance.atoll'.*max_failing_fraction"):
        load(tmp_path, "acceptance: {atoll: 0.1}")


def test_rule_hash_is_canonical_and_sensitive(tmp_path):
    a = load(tmp_path, "acceptance: {max_flips: 0, loss_atol: 0.05}").acceptance.sha256()
    b = load(tmp_path, "acceptance: {loss_atol: 0.05, max_flips: 0}").acceptance.sha256()
    c = load(tmp_path, "acceptance: {loss_atol: 0.05, max_flips: 1}").acceptance.sha256()
    assert a == b != c
    assert load(tmp_path, "acceptance: {loss_atol: 1}").acceptance.loss_atol == 1.0  # ints are numbers too


def test_dvc_yaml_and_paths_table_agree():
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    declared = set()
    for stage in dvc["stages"].values():
        for kind in ("outs", "metrics"):
            for item in stage.get(kind, []):
                declared.add(next(iter(item)) if isinstance(item, dict) else item)
    d = "${item.variant}"
    expected = {
        str(paths.PREPARED_CASES), str(paths.PREPARED_TRAIN), str(paths.REFERENCE),
        str(paths.trial(d)), str(paths.compare(d)), str(paths.diagnose(d)), str(paths.decision(d)),
        str(paths.decision_metrics(d)), str(paths.benchmark_metrics(d)), str(paths.REPORT_CURVES),
    }
    assert expected <= declared, expected - declared
    assert not any(p.startswith(f"{paths.METRICS}/compare") for p in declared), (
        "compare's big JSON is no longer a DVC metric (issue 16)"
    )


def test_each_stage_declares_only_sections_that_exist():
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    sections = {f.name for f in config.dataclasses.fields(config.Params)}
    for name, stage in dvc["stages"].items():
        for p in stage.get("params", []):
            key = p if isinstance(p, str) else next(iter(p))
            if key.endswith(".yaml"):  # a whole params file (publish labels runs with every param)
                continue
            assert key.split(".")[0] in sections, (name, key)


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.params.yaml")), ids=lambda p: p.name)
def test_shipped_example_params_are_valid(path):
    params = config.load_params(path)
    assert params.task.kind in ("classification", "regression")


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


def test_a_params_file_that_cannot_be_read_or_a_seed_torch_cannot_take_is_one_line(tmp_path):
    """A folder passed as --params, a file that is not UTF-8 text, and a seed of 2**64 (torch's generators take 64
    bits: it crashed freeze with "ValueError: Overflow") are refused when params load, each with its fix."""
    with pytest.raises(UserError, match="is a folder, not a params file"):
        load_params(tmp_path)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("seed: 0  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match="is not UTF-8 text"):
        load_params(latin)
    big = tmp_path / "big.yaml"
    big.write_text(f"seed: {2**64}\n")
    with pytest.raises(UserError, match=r"seed is 18446744073709551616; give one below 2\*\*63"):
        load_params(big)
    big.write_text(f"seed: {2**63 - 1}\n")
    assert load_params(big).seed == 2**63 - 1


@pytest.mark.parametrize(
    "text, words",
    [
        ("seed: 010", "seed is 010 (line 1), which YAML 1.1 (PyYAML) and YAML 1.2 (DVC) read differently"),  # 8 vs 10
        ("seed: 08", "seed is 08 (line 1)"),  # text vs 8
        ("seed: 0o10", "seed is 0o10 (line 1)"),  # text vs 8
        ("reference:\n  train_steps: 1:30", "reference.train_steps is 1:30 (line 2)"),  # 90 vs text
        ("prepare: {edge_scales: [1.0, 08]}", "prepare.edge_scales[1] is 08"),
        ("reference:\n  lr: 0.05\n  momentum: 0.9\n  lr: 0.5", "key 'reference.lr' is given twice (lines 2 and 4)"),
    ],
)
def test_a_key_given_twice_or_a_number_yaml_1_1_and_dvc_read_differently_is_refused(tmp_path, text, words):
    """The stages read what dvc.lock records or nothing: `seed: 010` trained with seed 8 (PyYAML, YAML 1.1) while
    DVC (ruamel, YAML 1.2) recorded 10, and a key given twice was silently its last value where DVC refuses the file."""
    (tmp_path / "params.yaml").write_text(text + "\n")
    with pytest.raises(UserError) as err:
        load_params(tmp_path / "params.yaml")
    assert words in str(err.value) and "\n" not in str(err.value)
    assert "quote it" in str(err.value) or "keep one" in str(err.value)


def test_quoted_text_and_the_numbers_both_yaml_versions_agree_on_load_as_dvc_reads_them(tmp_path):
    from ruamel.yaml import YAML

    text = "seed: 0x10\ntracking: {experiment: '010'}\nreference: {lr: +.5, train_steps: 1_000}\n"
    (tmp_path / "params.yaml").write_text(text)
    params, dvcs = load_params(tmp_path / "params.yaml"), YAML(typ="safe").load(text)
    assert (params.seed, params.tracking.experiment) == (dvcs["seed"], dvcs["tracking"]["experiment"]) == (16, "010")
    assert (params.reference.lr, params.reference.train_steps) == (0.5, 1000) == tuple(dvcs["reference"].values())
    # dvc.lock is DVC's writing: text that YAML 1.1 took for a base-60 number is text there too (publish's freshness check)
    assert yaml.load("experiment: 1:30\n", Loader=config.Yaml12Loader) == YAML(typ="safe").load("experiment: 1:30\n")
    held = yaml.load("a: &x [1, *x]\n", Loader=config.ParamsLoader)["a"]  # an alias is checked once: no endless walk
    assert held[0] == 1 and held[1] is held


def test_a_compiled_variant_with_dropout_on_at_inference_is_refused_in_one_line(tmp_path):
    """reference.eval_mode: false keeps dropout on at inference, every pass drawing eager's masks from one seed; inductor
    draws its own, so a compiled trial would differ from FP32 by the draws (every value, many decisions) and be rolled
    back for them (probe: a float32_inductor trial of an FP32 model, 1,444 of 1,500 values out of tolerance)."""
    compiled = "trial: {variants: [c], policies: {c: {dtype: bfloat16, compile: inductor}}}"
    with pytest.raises(UserError) as err:
        load(tmp_path, f"reference: {{eval_mode: false}}\n{compiled}")
    message = str(err.value)
    assert "\n" not in message and "reference.eval_mode: false" in message and "'c'" in message
    assert "compile: off in trial.policies.c" in message
    assert load(tmp_path, compiled).trial.policies["c"].compile == "inductor"  # dropout off: compiled trials are fine
    assert not load(tmp_path, "reference: {eval_mode: false}").reference.eval_mode  # eager trials: one seed, fine


def test_the_fp32_a_a_variant_loads_and_its_manifest_names_its_data_order(tmp_path):
    params = config.load_params(ROOT / "params.yaml")
    swapped = params.trial.policies["float32_swapped"]
    assert swapped == config.Policy(data_order="swapped") and "float32_swapped" not in params.trial.variants
    assert swapped.as_dict() == {"dtype": "float32", "fp32_modules": [], "data_order": "swapped"}
    assert "data_order" not in params.trial.policies["float16"].as_dict()  # every other manifest's bytes as they were
    assert config.Policy.from_dict(swapped.as_dict()) == swapped


def _alias_bomb(levels: int = 9) -> str:
    """task.options holding ``10**levels`` values once expanded (each level: a list of ten aliases of the one before)."""
    lines = ["task:", "  options:", "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines)


ABUSES = [  # params that asked for unbounded work: each refused at load, in one line naming the key (issue 50)
    (_alias_bomb(), ["task.options holds more than 10,000 values", "YAML aliases"]),  # hung freeze (dataclasses.asdict)
    ("task:\n  options:\n    a: &x [1, *x]", ["task.options nests more than 32 levels", "holds itself"]),
    ("reference: {train_steps: 1e12}", ["reference.train_steps is 1,000,000,000,000", "at most 10,000,000"]),  # MemoryError
    ("reference: {train_steps: 1000000, grad_accumulation: 100}", ["train_steps x grad_accumulation", "at most 10,000,000"]),
    ("reference: {batch_size: 1e12}", ["reference.batch_size", "at most"]),
    ("reference: {boundary_cases: 1e9}", ["reference.boundary_cases", "at most 100,000"]),
    ("threads: 1000000", ["threads is 1,000,000", "at most 1,024"]),  # died inside libgomp
    ("prepare: {ordinary_cases: 1e12}", ["prepare.ordinary_cases", "at most 10,000,000"]),
    ("prepare: {edge_samples: 1e12}", ["prepare.edge_samples", "at most"]),
    ("bench: {repeats: 1e9}", ["bench.repeats", "at most 100,000"]),
    ("compare: {chunk_elements: 1e15}", ["compare.chunk_elements", "at most 1,000,000,000"]),
    ("compare: {max_listed_flips: 1e12}", ["compare.max_listed_flips", "at most 1,000,000"]),
    ("distributed: {nproc_per_node: 100000}", ["distributed.nproc_per_node", "at most 64"]),
    ("diagnose: {search_budget: 1e9}", ["diagnose.search_budget", "at most 1,000"]),
    ('tracking: {experiment: "amp\\x07\\nvalidation"}', ["tracking.experiment", "non-printable character '\\x07'"]),
    (f"tracking: {{experiment: {'x' * 600}}}", ["tracking.experiment is 600 characters long", "at most 500"]),
    ('trial: {variants: ["f\\x1b[2Jp16"]}', ["trial.variants[0]", "non-printable"]),
    ('trial: {variants: [float16], policies: {float16: {dtype: float16, fp32_modules: ["enc\\tx"]}}}',
     ["trial.policies.float16.fp32_modules[0]", "non-printable"]),
]


@pytest.mark.parametrize("text, words", ABUSES, ids=[w[0].split(" ")[0] for _, w in ABUSES])
def test_params_that_ask_for_unbounded_work_or_unprintable_names_are_refused_at_load_within_a_second(tmp_path, text, words):
    """An alias bomb under task.options hung freeze, train_steps: 1e12 ended in a MemoryError, threads: 1000000 died in
    libgomp, and control characters in tracking.experiment made that MLflow experiment: each is one line, exit 2,
    from the real entry point, before anything is computed."""
    (tmp_path / "params.yaml").write_text(text + "\n")
    start = time.perf_counter()
    with pytest.raises(UserError) as err:
        load_params(tmp_path / "params.yaml")
    assert time.perf_counter() - start < 1.0
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), (words, message)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--params", str(tmp_path / "params.yaml")],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr == f"error: {message}\n", (proc.returncode, proc.stderr[-2000:])
    assert not (tmp_path / "data").exists()


def test_the_bounds_take_what_a_real_run_asks_for(tmp_path):
    """The ceilings are generous: each limit itself loads, and so do options of a few hundred values with aliases."""
    options = "\n".join(["task:", "  options:", "    base: &b {width: 64, depth: 4, dropout: [0.1, 0.2]}",
                         "    heads: [*b, *b, *b]", f"    weights: [{', '.join(['1.0'] * 500)}]"])
    params = load(tmp_path, options + f"\nthreads: {config.MAX_THREADS}\nreference: {{train_steps: 1e7, batch_size: 1e7}}\n"
                  f"distributed: {{nproc_per_node: {config.MAX_NPROC_PER_NODE}}}\ntracking: {{experiment: 'AMP — été 2026'}}")
    assert params.task.options["heads"][2]["width"] == 64 and len(params.task.options["weights"]) == 500
    assert (params.threads, params.reference.train_steps, params.tracking.experiment) == (1024, 10**7, "AMP — été 2026")
