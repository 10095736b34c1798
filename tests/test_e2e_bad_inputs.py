"""Bad input, as a table: one line naming the problem and the fix, exit 2, no traceback, outputs untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml
from _project import stage

pytestmark = pytest.mark.integration


def edit_params(repo: Path, change) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    change(params)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def setter(path: str, value):
    def change(params):
        *parents, last = path.split(".")
        node = params
        for p in parents:
            node = node[p]
        node[last] = value

    return change


def user_module(source: str):
    def apply(repo: Path):
        (repo / "badmods").mkdir(exist_ok=True)
        (repo / "badmods" / "__init__.py").write_text("")
        (repo / "badmods" / "m.py").write_text(textwrap.dedent(source))

    return apply


WRONG_SHAPE = """
import torch
def load_data(**_):
    x = torch.randn(40, 4); y = torch.randint(0, 3, (40,))
    return {"train_x": x, "train_y": y, "eval_x": x[:8], "eval_y": y[:8]}
def build_model(**_):
    return torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Flatten(0))
"""

NAN_DATA = """
import torch
def load_data(**_):
    x = torch.randn(40, 4); x[3, 1] = float("nan"); y = torch.randint(0, 3, (40,))
    return {"train_x": x, "train_y": y, "eval_x": x[:8], "eval_y": y[:8]}
"""

EMPTY_EVAL = """
import torch
def load_data(**_):
    x = torch.randn(40, 4); y = torch.randint(0, 3, (40,))
    return {"train_x": x, "train_y": y, "eval_x": x[:0], "eval_y": y[:0]}
"""

NAN_REFERENCE = """
import torch
def load_data(**_):
    x = torch.rand(64, 4) + 0.1; y = torch.randint(0, 3, (64,))
    return {"train_x": x, "train_y": y, "eval_x": x[:16], "eval_y": y[:16]}
class LogNet(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        return self.fc(torch.log(x))   # log(0) on the edge case 'zeros': -inf in FP32 already
def build_model(**_):
    return LogNet()
"""

DATASET = """
import torch
class Items(torch.utils.data.Dataset):
    def __init__(self, raise_at=None, nan_at=None):
        self.raise_at, self.nan_at = raise_at, nan_at
    def __len__(self):
        return 40
    def __getitem__(self, i):
        x = torch.rand(4, generator=torch.Generator().manual_seed(i))
        if i == self.raise_at:
            1 / 0            # a bug in the user's __getitem__
        if i == self.nan_at:
            x[1] = float("nan")
        return x, torch.tensor(i % 3)
def _data(train):
    x = torch.rand(16, 4); y = torch.randint(0, 3, (16,))
    return {"train_x": train, "eval_x": x, "eval_y": y}
def load_data(**_):
    return _data(Items(raise_at=20))  # an item prepare's fingerprint reads (0, n/2, n-1)
def load_nan_item(**_):
    return _data(Items(nan_at=7))     # an item prepare does not read: met in training
def load_float_targets(**_):
    x = torch.rand(40, 4); y = torch.rand(40) * 3   # class targets 0.0..3.0 that .long() would truncate
    return {"train_x": x, "train_y": y, "eval_x": x[:8], "eval_y": y[:8]}
def build_model(**_):
    return torch.nn.Linear(4, 3)
"""


def params_case(path, value):
    return lambda repo: edit_params(repo, setter(path, value))


def write(rel: str, data: bytes):
    def apply(repo: Path):
        (repo / rel).write_bytes(data)

    return apply


def truncate(rel: str):
    def apply(repo: Path):
        p = repo / rel
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    return apply


def flip_byte(rel: str):
    def apply(repo: Path):
        p = repo / rel
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        p.write_bytes(bytes(raw))

    return apply


def pickle_as_safetensors(repo: Path):
    """A pickle renamed to .safetensors, with the manifest hash forged to match: the parser must refuse it."""
    import pickle

    target = repo / "data/reference/checkpoint.safetensors"
    target.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    manifest_path = repo / "data/reference/manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["data/reference/checkpoint.safetensors"] = hashlib.sha256(target.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def swap_checkpoint(repo: Path):
    shutil.copy(repo / "data/trial/float16/checkpoint.safetensors", repo / "data/reference/checkpoint.safetensors")


def unwritable_output(repo: Path):
    target = repo / "data/compare/float16"
    shutil.rmtree(target)
    target.write_text("not a folder")  # a read-only folder is replaced whole through its parent: a file is what blocks


def both(*changes):
    def apply(repo: Path):
        for c in changes:
            c(repo)

    return apply


# (name, mutation, stage args, words the one-line message must contain)
CASES = [
    ("malformed yaml", write("params.yaml", b"seed: [0\ntask: {"), ["prepare"], ["not valid YAML", "line"]),
    ("params not a mapping", write("params.yaml", b"- 1\n- 2\n"), ["prepare"], ["must be a mapping"]),
    ("unknown top-level key", params_case("sede", 1), ["prepare"], ["unknown key 'sede'"]),
    ("unknown nested key", params_case("acceptance.atoll", 0.1), ["decide", "--variant", "float16"], ["acceptance.atoll"]),
    ("wrong type", params_case("reference.train_steps", "sixty"), ["freeze"], ["reference.train_steps", "integer"]),
    ("negative tolerance", params_case("acceptance.outputs", {"*": {"atol": -0.1, "rtol": 0.0}}),
     ["decide", "--variant", "float16"], ["atol", "0 or more"]),
    ("fraction above one", params_case("acceptance.max_failing_fraction", 1.5),
     ["decide", "--variant", "float16"], ["max_failing_fraction", "between 0 and 1"]),
    ("unknown variant in params", params_case("trial.variants", ["fp8"]),
     ["trial", "--variant", "float16"], ["trial.variants lists 'fp8'", "trial.policies.fp8"]),
    ("unknown dtype on the command line", None, ["trial", "--variant", "fp8"], ["fp8"]),
    ("missing --variant", None, ["trial"], ["needs --variant NAME", "'float16', 'bfloat16'"]),
    ("dtype not in trial.variants", params_case("trial.variants", ["bfloat16"]),
     ["trial", "--variant", "float16"], ["not in trial.variants"]),
    ("empty trial.variants", params_case("trial.variants", []), ["trial", "--variant", "float16"], ["trial.variants is empty"]),
    ("unknown device", params_case("device", "tpu"), ["freeze"], ["device", "'cuda'"]),
    ("cuda without a GPU", params_case("device", "cuda"), ["freeze"], ["no CUDA or ROCm GPU", "device: cpu"]),
    ("model not module:function", params_case("task.model", "digits.build"), ["prepare"], ["task.model", "module:function"]),
    ("module does not import", params_case("task.data", "no_such_module:load"), ["prepare"], ["does not import", "PYTHONPATH"]),
    ("function missing", params_case("task.data", "pipeline.examples.digits:nope"), ["prepare"], ["has no function 'nope'"]),
    ("loss does not fit kind", params_case("task.loss", "mse"), ["prepare"], ["task.loss", "cross_entropy"]),
    ("one training step: a replicate that repeats the reference", params_case("reference.train_steps", 1), ["freeze"],
     ["FP32 replicate repeats the reference's losses exactly", "loss_noise_multiple: null"]),
    ("model returns wrong shape",
     both(user_module(WRONG_SHAPE), params_case("task.model", "badmods.m:build_model"),
          params_case("task.data", "badmods.m:load_data"), lambda r: (stage(r, "prepare"), None)[1]),
     ["freeze"], ["shape", "[N, classes>=2]"]),
    ("model does not take the data", both(user_module(WRONG_SHAPE), params_case("task.model", "badmods.m:build_model")),
     ["freeze"], ["fails on a batch", "(2, 64)"]),
    ("data with NaN", both(user_module(NAN_DATA), params_case("task.data", "badmods.m:load_data")),
     ["prepare"], ["NaN or inf", "clean the data"]),
    ("empty fixed set", both(user_module(EMPTY_EVAL), params_case("task.data", "badmods.m:load_data")),
     ["prepare"], ["eval_x is empty"]),
    ("reference with NaN",
     both(user_module(NAN_REFERENCE), params_case("task.model", "badmods.m:build_model"),
          params_case("task.data", "badmods.m:load_data"), lambda r: (stage(r, "prepare"), None)[1]),
     ["freeze"], ["reference is not finite", "edge/zeros"]),
    # An op without a float16 kernel is no bad input any more: the variant's rollback (tests/test_e2e_failed_variant.py).
    ("Dataset item raises", both(user_module(DATASET), params_case("task.data", "badmods.m:load_data")),
     ["prepare"], ["raised ZeroDivisionError on item 20", "__getitem__"]),
    ("float class targets", both(user_module(DATASET), params_case("task.data", "badmods.m:load_float_targets")),
     ["prepare"], ["train_y", "whole numbers", "task.kind: regression"]),
    ("NaN in one training item",
     both(user_module(DATASET), params_case("task.data", "badmods.m:load_nan_item"),
          params_case("task.model", "badmods.m:build_model"), lambda r: (stage(r, "prepare"), None)[1]),
     ["freeze"], ["training item 7", "NaN or inf", "step"]),
    ("missing output file", lambda r: (r / "data/reference/manifest.json").unlink(),
     ["trial", "--variant", "float16"], ["manifest.json not found", "dvc repro freeze"]),
    ("missing params file", None, ["prepare", "--params", "nope.yaml"], ["nope.yaml not found"]),
    ("truncated checkpoint", truncate("data/reference/checkpoint.safetensors"),
     ["trial", "--variant", "float16"], ["sha256", "dvc checkout"]),
    ("flipped byte in checkpoint", flip_byte("data/reference/checkpoint.safetensors"),
     ["trial", "--variant", "float16"], ["sha256", "damaged or replaced"]),
    ("checkpoint swapped for another run's", swap_checkpoint, ["trial", "--variant", "float16"], ["sha256"]),
    ("pickle renamed to .safetensors", pickle_as_safetensors,
     ["trial", "--variant", "float16"], ["not a valid safetensors", "pickle"]),
    ("rule edited after freeze", params_case("acceptance.max_flips", 5),
     ["decide", "--variant", "float16"], ["differs from the one frozen", "dvc repro"]),
    ("data changed after freeze", flip_byte("data/prepared/train.safetensors"),
     ["trial", "--variant", "float16"], ["differs from the data the reference was frozen on"]),
    ("corrupted stats JSON", write("data/compare/float16/stats.json", b"{not json"),
     ["decide", "--variant", "float16"], ["not valid JSON"]),
    ("unknown fp32 module", params_case("trial.policies.float16.fp32_modules", ["encoder.9"]),
     ["trial", "--variant", "float16"], ["fp32_modules", "'encoder.9'"]),
    ("output folder not writable", unwritable_output, ["compare", "--variant", "float16"], ["cannot write", "move it away"]),
]


def tree_digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "data").rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("name,mutate,args,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_clear_line(reproduced, tmp_path, name, mutate, args, words):
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    if mutate is not None:
        mutate(repo)
    before = tree_digest(repo)
    proc = stage(repo, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert tree_digest(repo) == before, "a failing stage changed existing outputs"


# A stage run before the one whose output it reads, in a fresh project (nothing run yet): (stage args, the stage the
# one line names). freeze before prepare raised FileNotFoundError for data/prepared/cases.safetensors (issue 50).
OUT_OF_ORDER = [
    (["freeze"], "prepare"),
    (["trial", "--variant", "float16"], "freeze"),
    (["compare", "--variant", "float16"], "trial@float16"),
    (["diagnose", "--variant", "float16"], "trial@float16"),
    (["decide", "--variant", "float16"], "freeze"),
    (["benchmark", "--variant", "float16"], "decide@float16"),
    (["report"], "freeze"),
    (["publish"], "freeze"),
    (["restore", "--variant", "float16"], "decide@float16"),
]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """The project copied, a git + DVC repository, no stage run (read-only: copy it before running a stage)."""
    from conftest import make_project

    return make_project(tmp_path_factory.mktemp("fresh") / "repo")


@pytest.mark.parametrize("args,first", OUT_OF_ORDER, ids=[" ".join(a) for a, _ in OUT_OF_ORDER])
def test_a_stage_run_out_of_order_names_the_stage_to_run_first(fresh, tmp_path, args, first):
    repo = tmp_path / "repo"
    shutil.copytree(fresh, repo, symlinks=True)
    proc = stage(repo, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("error: ") and f"run `dvc repro {first}` first" in lines[0], lines[0]
    assert tree_digest(repo) == {}, "a stage run out of order wrote outputs"
