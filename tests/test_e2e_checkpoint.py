"""Starting from a user's checkpoint through a real `dvc repro` (issue 52 item 2): ``reference.checkpoint`` names a
safetensors file from which the reference, its replicates and every trial start.

The "user's" checkpoints are real files this pipeline wrote in another project (the tiny digits run): a float16 trial's
checkpoint (weights, SGD momentum, an enabled GradScaler's state) and the same weights alone, as
``safetensors.torch.save_file(model.state_dict())`` writes them. Three questions a user asks:
- can I serve my trained model in bfloat16? (``train_steps: 0`` on the weights alone: an inference-only verdict);
- can I continue my run in AMP? (training from the checkpoint with its optimizer and GradScaler state);
- does a new checkpoint re-freeze? (DVC sees the file as freeze's dep: its content, not its name).
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from safetensors.torch import load_file, save_file

from _project import dvc, stage, write_params
from conftest import make_project
from pipeline import checkpoint, dcp

pytestmark = pytest.mark.integration

CKPT = "start/model.safetensors"


def read(repo, path):
    return json.loads((repo / path).read_text())


def with_checkpoint(repo, source, override: dict, dep: bool = True) -> None:
    """``source`` as the repo's CKPT, reference.checkpoint naming it, and (``dep``) freeze's deps listing it."""
    (repo / CKPT).parent.mkdir(exist_ok=True)
    shutil.copy2(source, repo / CKPT)
    write_params(repo, {**override, "reference": {**override.get("reference", {}), "checkpoint": CKPT}})
    if dep:
        spec = yaml.safe_load((repo / "dvc.yaml").read_text())
        spec["stages"]["freeze"]["deps"].append(CKPT)
        (repo / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A float16 trial's checkpoint (weights, optimizer, GradScaler) and its weights alone, from a tiny digits run. Its
    scale is set to 1024 (a value no fresh GradScaler starts at) so that a run that reads it is seen to."""
    root = tmp_path_factory.mktemp("user")
    repo = make_project(root / "repo", {"trial": {"variants": ["float16"]}})
    dvc(repo, "repro", "trial@float16")
    saved = checkpoint.load(repo / "data/trial/float16/checkpoint.safetensors")
    assert saved.info.grad_scaler and any(k.startswith("optim/") for k in saved.tensors), saved.info
    full = root / "full.safetensors"
    checkpoint.save(full, checkpoint.Checkpoint(saved.tensors, checkpoint.replace(
        saved.info, grad_scaler={**saved.info.grad_scaler, "scale": 1024.0})))
    weights = root / "weights.safetensors"
    save_file(saved.model_state(), weights)
    other = root / "other.safetensors"  # the FP32 reference's trained weights: another checkpoint of the same model
    save_file(checkpoint.load(repo / "data/reference/checkpoint.safetensors").model_state(), other)
    return {"full": full, "weights": weights, "other": other}


def test_an_inference_only_verdict_on_a_loaded_checkpoint_and_a_new_checkpoint_refreezes(trained, tmp_path):
    repo = make_project(tmp_path / "repo", {"trial": {"variants": ["float16", "bfloat16"]}})
    with_checkpoint(repo, trained["weights"], {"reference": {"train_steps": 0}})
    out = dvc(repo, "repro", "--glob", "decide@*").stdout
    assert "freeze: reference not trained" in out, out

    init = load_file(repo / "data/reference/init.safetensors")  # the reference starts from the user's weights
    for name, value in load_file(trained["weights"]).items():
        assert init[f"model/{name}"].equal(value), name
    manifest = read(repo, "data/reference/manifest.json")
    assert manifest["files"][CKPT] == checkpoint.sha256_file(trained["weights"])
    # Untrained, the digits net is at chance and freeze refuses min_quality 0.5: the loaded weights pass it.
    quality = read(repo, "data/compare/float16/stats.json")["quality"]
    assert quality["reference"] >= 0.5, quality
    for variant in ("float16", "bfloat16"):
        d = read(repo, f"data/decision/{variant}/decision.json")
        assert d["training"] == "not judged" and d["inference"] == d["decision"], d

    # Another file at the same path: no param changed, DVC re-freezes because the file is freeze's dep.
    (repo / CKPT).unlink()  # a new file, as a user's save writes one (DVC's cache of hashes keys on inode, mtime, size)
    shutil.copyfile(trained["other"], repo / CKPT)
    assert "freeze" in dvc(repo, "status", "freeze").stdout
    again = dvc(repo, "repro", "--glob", "decide@*").stdout
    assert "Running stage 'freeze'" in again, again
    refrozen = read(repo, "data/reference/manifest.json")
    assert refrozen["files"][CKPT] == checkpoint.sha256_file(trained["other"]) != manifest["files"][CKPT]
    assert refrozen["run_key"] != manifest["run_key"]


def test_training_continues_from_a_checkpoints_optimizer_and_gradscaler_state(trained, tmp_path):
    repo = make_project(tmp_path / "repo", {"trial": {"variants": ["float16", "bfloat16"]}})
    with_checkpoint(repo, trained["full"], {"reference": {"train_steps": 8, "checkpoint_every": 0}})
    dvc(repo, "repro", "--glob", "decide@*")

    init = load_file(repo / "data/reference/init.safetensors")
    saved = checkpoint.load(trained["full"])
    momentum = [k for k in saved.tensors if k.startswith("optim/")]
    assert momentum and all(init[k].equal(saved.tensors[k]) for k in momentum)  # kept in the reference's start
    steps = read(repo, "data/trial/float16/trajectory.json")["steps"]
    assert steps[0]["scale"] == 1024.0, steps[0]  # the GradScaler continued from the checkpoint's scale
    assert read(repo, "data/trial/bfloat16/trajectory.json")["steps"][0]["scale"] == 1.0  # no scaler under bfloat16
    for variant in ("float16", "bfloat16"):
        d = read(repo, f"data/decision/{variant}/decision.json")
        assert d["training"] in ("accept", "rollback") and any(c.startswith("training:") for c in d["checks"]), d


def test_a_missing_mismatched_or_untracked_checkpoint_is_one_line(trained, tmp_path):
    repo = make_project(tmp_path / "repo")
    dvc(repo, "repro", "prepare")

    def refused(*needles: str) -> None:
        run = stage(repo, "freeze")
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
        assert all(n in lines[0] for n in needles), lines[0]

    write_params(repo, {"reference": {"checkpoint": "start/none.safetensors"}})
    refused("reference.checkpoint start/none.safetensors not found", "null")
    with_checkpoint(repo, trained["weights"], {}, dep=False)
    refused("not in freeze's deps", f"add `- {CKPT}` to stages.freeze.deps")
    with_checkpoint(repo, trained["weights"], {"task": {"options": {"hidden": 48}}})
    refused("does not fit task.model", "of another shape", "task.options")
    (repo / CKPT).write_bytes(b"not a safetensors file")
    refused("is not a safetensors file", "save_file")


DCP = "start/dcp"


def save_dcp(folder, state: dict) -> None:
    """``state`` as a torch distributed checkpoint's folder (``dcp.save`` in one process, as FSDP2 teams' ranks write)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    shutil.rmtree(folder, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(state, checkpoint_id=str(folder))


def test_a_dcp_folder_starts_freeze_a_new_one_refreezes_and_a_pickle_in_its_metadata_never_runs(trained, tmp_path):
    repo = make_project(tmp_path / "repo")
    saved = checkpoint.load(trained["full"])
    save_dcp(repo / DCP, {"model": saved.model_state(), "optim": checkpoint._optimizer_state(saved)})
    write_params(repo, {"reference": {"checkpoint": DCP, "train_steps": 2, "checkpoint_every": 0}})
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())
    spec["stages"]["freeze"]["deps"].append(DCP)  # DVC tracks a folder as one dep: any file of it changed re-runs freeze
    (repo / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    dvc(repo, "repro", "freeze")

    init = load_file(repo / "data/reference/init.safetensors")  # the reference starts from the folder's weights
    assert all(init[f"model/{k}"].equal(v) for k, v in saved.model_state().items())
    momentum = [k for k in saved.tensors if k.startswith("optim/")]
    assert momentum and all(init[k].equal(saved.tensors[k]) for k in momentum)  # and its SGD momentum
    manifest = read(repo, "data/reference/manifest.json")
    assert manifest["files"][DCP] == dcp.folder_digest(repo / DCP)

    save_dcp(repo / DCP, {"model": load_file(trained["other"])})  # another run's weights, the same path
    assert "freeze" in dvc(repo, "status", "freeze").stdout
    assert "Running stage 'freeze'" in dvc(repo, "repro", "freeze").stdout
    refrozen = read(repo, "data/reference/manifest.json")
    assert refrozen["files"][DCP] != manifest["files"][DCP] and refrozen["run_key"] != manifest["run_key"]
    assert load_file(repo / "data/reference/init.safetensors")["model/" + next(iter(saved.model_state()))].equal(
        load_file(trained["other"])[next(iter(saved.model_state()))])

    marker = tmp_path / "ran"
    # os.system("touch MARKER") in pickle's opcodes: the plain pickle.load of DCP's own loader would run it
    (repo / DCP / ".metadata").write_bytes(b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")
    assert "freeze" in dvc(repo, "status", "freeze").stdout  # .metadata alone changed: DVC sees it
    before = {p: p.read_bytes() for p in (repo / "data/reference").iterdir() if p.is_file()}
    run = stage(repo, "freeze")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"{DCP}/.metadata was refused unread (it names os.system" in lines[0], lines[0]
    assert not marker.exists()
    assert {p: p.read_bytes() for p in (repo / "data/reference").iterdir() if p.is_file()} == before  # nothing overwritten
