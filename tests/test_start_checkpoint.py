"""checkpoint.start / continue_optimizer / continue_schedule (issue 52 item 2): the state a run starts from when
``reference.checkpoint`` names a user's file, on a real model, real optimizers and real safetensors files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pipeline import checkpoint, dcp
from pipeline.errors import UserError


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def trained_state(optimizer: str = "sgd", enabled_scaler: bool = True) -> checkpoint.Checkpoint:
    """Weights, optimizer and GradScaler state after two real updates, as training captures them."""
    model = net(1)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=0.01))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=enabled_scaler)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return checkpoint.capture(model, opt, scaler, step=2, real_updates=2, records=[{}, {}])


def test_no_checkpoint_is_the_model_as_built():
    model = net()
    init, inputs = checkpoint.start(None, model)
    built = checkpoint.capture(model)
    assert inputs == {} and checkpoint.tensors_digest(init.tensors) == checkpoint.tensors_digest(built.tensors)


def test_a_pipeline_checkpoint_gives_weights_optimizer_and_scaler_but_not_another_runs_counters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no dvc.yaml here: nothing to check the deps against
    saved = trained_state()
    checkpoint.save("ckpt.safetensors", saved)
    model = net()
    init, inputs = checkpoint.start("ckpt.safetensors", model)
    assert inputs == {"ckpt.safetensors": checkpoint.sha256_file("ckpt.safetensors")}
    assert all(torch.equal(v, saved.model_state()[k]) for k, v in model.state_dict().items())
    assert init.info.grad_scaler["scale"] == saved.info.grad_scaler["scale"]
    assert (init.info.step, init.info.records) == (None, None)

    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    checkpoint.continue_optimizer(init, opt, "sgd")
    scaler = torch.amp.GradScaler("cpu")
    checkpoint.continue_schedule(init, scaler, None)
    assert scaler.get_scale() == saved.info.grad_scaler["scale"] and opt.param_groups[0]["lr"] == 0.1
    before = {k: v.clone() for k, v in init.tensors.items() if k.startswith("optim/")}
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # moves the optimizer's momentum in place: never the start's own tensors
    assert all(torch.equal(init.tensors[k], v) for k, v in before.items())


def test_weights_alone_in_another_dtype_load_and_carry_no_optimizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_file({k: v.to(torch.bfloat16) for k, v in net(1).state_dict().items()}, "w.safetensors")
    model = net()
    init, _ = checkpoint.start("w.safetensors", model)
    assert model[0].weight.dtype == torch.float32 and init.info.optim_param_groups is None
    assert not any(k.startswith("optim/") for k in init.tensors)


def test_an_adam_state_for_an_sgd_run_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint.save("adamw.safetensors", trained_state("adamw", enabled_scaler=False))
    model = net()
    init, _ = checkpoint.start("adamw.safetensors", model)
    with pytest.raises(UserError, match="is not a sgd state .* set reference.optimizer"):
        checkpoint.continue_optimizer(init, torch.optim.SGD(model.parameters(), lr=0.1), "sgd")


def test_a_checkpoint_freezes_deps_do_not_list_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_file(net().state_dict(), "w.safetensors")
    (tmp_path / "dvc.yaml").write_text("stages:\n  freeze:\n    cmd: x\n    deps: [pipeline/stages/freeze.py]\n")
    with pytest.raises(UserError, match=r"not in freeze's deps .* add `- w.safetensors` to stages.freeze.deps"):
        checkpoint.start("w.safetensors", net())
    (tmp_path / "dvc.yaml").write_text("stages:\n  freeze:\n    cmd: x\n    deps: [w.safetensors]\n")
    checkpoint.start("w.safetensors", net())


# --- a torch distributed checkpoint's folder (DCP: torch.distributed.checkpoint.save) ----------------------------------

dcp_api = pytest.importorskip("torch.distributed.checkpoint")


def digest_of(files: dict[str, bytes]) -> str:
    """The folder's digest as docs/params.md defines it: sha256 over each file, in name order, of its relative name,
    its length and its bytes."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{len(files[name])}\0".encode() + files[name])
    return digest.hexdigest()


def save_dcp(folder, state: dict) -> str:
    """``state`` as ``dcp.save`` writes it in one process (no process group), the folder's path."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp_api.save(state, checkpoint_id=str(folder))
    return str(folder)


def test_a_dcp_folder_gives_weights_and_the_optimizers_state_and_its_digest_covers_every_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = trained_state("adamw", enabled_scaler=False)
    optim = checkpoint._optimizer_state(saved)
    save_dcp("dcp", {"model": saved.model_state(), "optim": optim, "lr_scheduler": {"last_epoch": 3}, "step": 2})
    model = net()
    init, inputs = checkpoint.start("dcp", model)
    assert all(torch.equal(v, saved.model_state()[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(init.tensors[k], v) for k, v in saved.tensors.items() if k.startswith("optim/"))
    assert (init.info.scheduler, init.info.grad_scaler) == ({}, {})  # the saving run's: not kept
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    checkpoint.continue_optimizer(init, opt, "adamw")
    assert opt.param_groups[0]["lr"] == 0.01 and torch.equal(opt.state[model[0].weight]["exp_avg"], optim["state"][0]["exp_avg"])

    save_dcp("app", {"app": {"model": saved.model_state(), "optim": optim}})  # the DCP recipe's AppState layout
    again, _ = checkpoint.start("app", net())
    assert all(torch.equal(again.tensors[k], v) for k, v in init.tensors.items())

    files = {p.name: p.read_bytes() for p in (tmp_path / "dcp").iterdir()}
    assert set(files) == {".metadata", "__0_0.distcp"} and inputs == {"dcp": digest_of(files)}
    assert dcp.folder_digest("dcp") == inputs["dcp"]  # hashed a block at a time: the same digest
    data = tmp_path / "dcp/__0_0.distcp"
    data.write_bytes(files["__0_0.distcp"][:-1] + bytes([files["__0_0.distcp"][-1] ^ 1]))
    assert dcp.folder_digest("dcp") != inputs["dcp"]


def test_a_dcp_folder_of_weights_alone_in_bfloat16_carries_no_optimizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_dcp("w", {k: v.to(torch.bfloat16) for k, v in net(1).state_dict().items()})  # torchtitan: weights at the top
    model = net()
    init, _ = checkpoint.start("w", model)
    assert model[0].weight.dtype == torch.float32 and init.info.optim_param_groups is None
    assert torch.equal(model[2].bias, net(1)[2].bias.to(torch.bfloat16).float())


def _fsdp_rank(rank: int, rendezvous: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    model = net(1)
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    weights, optim = get_state_dict(model, opt)  # the optimizer's state by parameter name, as FSDP2 teams save it
    dcp_api.save({"model": weights, "optim": optim}, checkpoint_id=out)
    dist.destroy_process_group()


def test_an_fsdp2_folder_of_two_ranks_is_put_together_as_dcp_itself_loads_it(tmp_path, monkeypatch):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2")
    torch.multiprocessing.spawn(_fsdp_rank, args=(str(tmp_path / "rdv"), str(tmp_path / "fsdp")), nprocs=2)
    monkeypatch.chdir(tmp_path)
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    model = net()
    init, _ = checkpoint.start("fsdp", model)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _load_state_dict_from_keys(checkpoint_id="fsdp")  # DCP's own reader (it unpickles): our own file
    assert all(torch.equal(v, theirs["model"][k]) for k, v in model.state_dict().items())
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        assert torch.equal(init.tensors[f"optim/{i}/exp_avg"], theirs["optim"]["state"][name]["exp_avg"]), name
    assert init.info.optim_param_groups[0]["params"] == list(range(len(names)))


def test_a_metadata_pickle_that_names_anything_else_is_refused_unrun(tmp_path, monkeypatch):
    import os
    import pickle

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    save_dcp("dcp", {"model": net().state_dict()})
    (tmp_path / "dcp/.metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UserError) as refused:
        checkpoint.start("dcp", net())
    message = str(refused.value)
    assert "dcp/.metadata was refused unread" in message and f"{os.system.__module__}.system" in message
    assert "\n" not in message and not marker.exists()

    from torch.distributed.checkpoint.metadata import Metadata

    (tmp_path / "dcp/.metadata").write_bytes(  # Metadata, then BUILD (None, {"marker": 1}): setattr on the class itself
        b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dVmarker\nI1\nstb.")
    with pytest.raises(UserError, match=r"refused unread \(it sets the state of type .*Metadata"):
        checkpoint.start("dcp", net())
    assert not hasattr(Metadata, "marker")


def test_a_value_that_is_no_plain_data_is_never_run(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    optim = checkpoint._optimizer_state(trained_state(enabled_scaler=False))
    optim["param_groups"][0]["lr"] = Payload()  # dcp.save writes it with torch.save: DCP's own load would run it
    save_dcp("dcp", {"model": net().state_dict(), "optim": optim})
    with pytest.raises(UserError, match=r"'optim' holds values that are not plain data; save optimizer.state_dict"):
        checkpoint.start("dcp", net())
    assert not marker.exists()


def test_chunks_outside_the_folder_and_flattened_optimizers_are_one_line(tmp_path, monkeypatch):
    import pickle

    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict()})
    md = pickle.loads((tmp_path / "dcp/.metadata").read_bytes())  # our own file: a plain load is safe here
    for info in md.storage_data.values():
        info.relative_path = "../secret"
    (tmp_path / "dcp/.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UserError, match=r"is stored in '../secret', no data file of the folder"):
        checkpoint.start("dcp", net())
    md.state_dict_metadata["model.0.weight"].size = torch.Size([10**9, 10**4])  # 40 TB: refused, never allocated
    (tmp_path / "dcp/.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UserError, match=r"'model.0.weight' is \[1000000000, 10000\] torch.float32: .* more than the folder"):
        checkpoint.start("dcp", net())

    save_dcp("flat", {"model": net().state_dict(), "optimizer": {"state.0.weight.momentum_buffer": torch.zeros(8, 4)}})
    with pytest.raises(UserError, match=r"its 'optimizer' is not an optimizer's state_dict .* or the weights alone"):
        checkpoint.start("flat", net())


def test_a_torch_without_dcps_metadata_classes_is_refused_in_one_line(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import metadata

    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict()})
    monkeypatch.delattr(metadata, "TensorStorageMetadata")  # as an older torch than 2.4 may lack
    with pytest.raises(UserError, match=r"has no TensorStorageMetadata .* use torch 2.4 or later, or load it where"):
        checkpoint.start("dcp", net())


# --- a crafted DCP folder (the reviewer's findings): each refused in one line, nothing of it run or read past ------------


def metadata(folder):
    import pickle

    return pickle.loads((tmp := __import__("pathlib").Path(folder) / ".metadata").read_bytes()), tmp  # our own file


def write_metadata(path, md) -> None:
    import pickle

    path.write_bytes(pickle.dumps(md))


def put(folder, md, fqn: str, raw: bytes, offsets=None) -> None:
    """``raw`` appended to the folder's data file, and the storage entry of ``fqn`` (``offsets``: its chunk's) pointed
    at it."""
    from pathlib import Path

    from torch.distributed.checkpoint.metadata import MetadataIndex

    data = Path(folder) / "__0_0.distcp"
    start = data.stat().st_size
    with data.open("ab") as out:
        out.write(raw)
    info = md.storage_data[MetadataIndex(fqn, None if offsets is None else torch.Size(offsets))]
    info.offset, info.length = start, len(raw)


def archive(obj, deflated: bool = False) -> bytes:
    """``obj`` as ``torch.save`` writes it (DCP's record of a chunk or a value); ``deflated``: its records compressed."""
    import io
    import zipfile

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    if not deflated:
        return buffer.getvalue()
    source, out = zipfile.ZipFile(io.BytesIO(buffer.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as packed:
        for info in source.infolist():
            packed.writestr(info.filename, source.read(info))
    return out.getvalue()


def test_no_record_of_the_folder_goes_through_torch_load_and_a_pickled_object_in_a_chunk_never_runs(tmp_path, monkeypatch):
    """torch.load(weights_only=True) runs code before torch 2.6 (CVE-2025-32434) and corrupts memory before 2.10
    (CVE-2026-24747); the project supports 2.4. The folder's archives are read without it, on every torch."""
    import os

    monkeypatch.chdir(tmp_path)
    saved = trained_state("adamw", enabled_scaler=False)
    save_dcp("dcp", {"model": saved.model_state(), "optim": checkpoint._optimizer_state(saved), "step": 2})

    def refused(*args, **kwargs):
        raise AssertionError("torch.load was called on a user's file")

    monkeypatch.setattr(torch, "load", refused)
    model = net()
    init, _ = checkpoint.start("dcp", model)
    assert all(torch.equal(v, saved.model_state()[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(init.tensors[k], v) for k, v in saved.tensors.items() if k.startswith("optim/"))

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    md, path = metadata("dcp")
    put("dcp", md, "model.0.weight", archive(Payload()), offsets=(0, 0))
    write_metadata(path, md)
    with pytest.raises(UserError) as out:
        checkpoint.start("dcp", net())
    assert f"a chunk of 'model.0.weight' is no plain tensor's archive (it names {os.system.__module__}.system" in str(
        out.value) and "nothing of it was run" in str(out.value) and "\n" not in str(out.value)
    assert not marker.exists()


def test_key_paths_grow_no_list_past_the_entries_and_nest_no_deeper_than_32(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict(), "extra": [torch.zeros(1) for _ in range(6)]})  # a list DCP flattens
    md, path = metadata("dcp")
    entries = len(md.state_dict_metadata)  # 10: each path element could have made an 8 MiB list before
    for bad in ({"extra.1": ("extra", 10**6)},  # one list of a million places
                {f"extra.{i}": ("extra", i, entries - 1) for i in range(6)},  # 6 lists of all entries' places
                {"extra.1": ("extra",) + ("deeper",) * 100}):
        write_metadata(path, dict_replace(md, planner_data={**md.planner_data, **bad}))
        with pytest.raises(UserError, match=r"dcp/.metadata: its key paths do not fit its entries .* save the checkpoint"):
            checkpoint.start("dcp", net())


def dict_replace(md, **fields):
    import copy

    md = copy.copy(md)
    for name, value in fields.items():
        setattr(md, name, value)
    return md


def test_a_compressed_record_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict()})
    md, path = metadata("dcp")
    put("dcp", md, "model.0.weight", archive(net().state_dict()["0.weight"], deflated=True), offsets=(0, 0))
    write_metadata(path, md)
    with pytest.raises(UserError, match=r"a chunk of 'model.0.weight' is no plain tensor's archive \(its record "
                                        r"'archive/data.pkl' is compressed or encrypted, which torch.save never does"):
        checkpoint.start("dcp", net())


def test_a_byte_range_two_entries_name_is_read_once_and_refused_the_second_time(tmp_path):
    save_dcp(tmp_path / "dcp", {"model": {"a": torch.ones(4), "b": torch.zeros(4)}})
    md, path = metadata(tmp_path / "dcp")
    from torch.distributed.checkpoint.metadata import MetadataIndex

    first = md.storage_data[MetadataIndex("model.a", torch.Size([0]))]
    second = md.storage_data[MetadataIndex("model.b", torch.Size([0]))]
    second.offset, second.length = first.offset, first.length  # N names on one chunk: N times the folder's size
    write_metadata(path, md)
    with pytest.raises(UserError, match=r"'model.b' is stored in bytes \d+\+\d+ of '__0_0.distcp', which another "
                                        r"entry uses too"):
        dcp.read(tmp_path / "dcp", "dcp")


def test_a_refused_metadata_pickle_is_named_by_its_type_never_by_its_str(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict()})
    # a list of two references to a list of two references ... 40 deep: its str would be 2**40 Nones long
    ops = b"\x80\x02Nq\x00" + b"".join(b"(h" + bytes([i]) + b"h" + bytes([i]) + b"lq" + bytes([i + 1]) for i in range(40))
    (tmp_path / "dcp/.metadata").write_bytes(ops + b"}b.")
    with pytest.raises(UserError, match=r"refused unread \(it sets the state of list, which DCP metadata never does\)"):
        checkpoint.start("dcp", net())


def test_links_and_special_files_in_the_folder_are_refused_and_never_read(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict()})
    os.symlink(tmp_path / "dcp", tmp_path / "alias")  # the folder the user names may itself be a link
    checkpoint.start("alias", net())
    (tmp_path / "secret").write_text("a private key")
    os.symlink(tmp_path / "secret", tmp_path / "dcp/id_rsa")
    with pytest.raises(UserError, match=r"reference.checkpoint dcp: 'id_rsa' is a symbolic link, not a file of the "
                                        r"folder: nothing outside it is read"):
        checkpoint.start("dcp", net())
    (tmp_path / "dcp/id_rsa").unlink()
    os.mkfifo(tmp_path / "dcp/pipe")  # reading it would block
    with pytest.raises(UserError, match=r"'pipe' is a FIFO, not a file of the folder"):
        checkpoint.start("dcp", net())


def test_a_chunk_of_another_dtype_or_outside_its_tensor_is_refused(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": {"w": torch.arange(4, dtype=torch.float64)}})
    md, path = metadata("dcp")
    md.state_dict_metadata["model.w"].properties.dtype = torch.float32  # cast without a word before
    write_metadata(path, md)
    with pytest.raises(UserError, match=r"a chunk of 'model.w' is stored as torch.float64, and its metadata says "
                                        r"torch.float32"):
        dcp.read(tmp_path / "dcp", "dcp")

    save_dcp("two", {"model": {"a": torch.arange(4.0), "b": torch.arange(4.0, 8.0)}})
    md, path = metadata("two")
    entry = md.state_dict_metadata.pop("model.a")
    md.state_dict_metadata.pop("model.b")
    entry.size = torch.Size([8])
    for chunks in ([(-8, 4), (4, 4)],  # a negative offset: slice(-8, -4) wraps onto 0:4, and passed the coverage check
                   [(0, 4), (4, 5)]):  # past the end
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([s])) for o, s in chunks]
        storage = {MetadataIndex("model.w", torch.Size([o])): md.storage_data[MetadataIndex(k, torch.Size([0]))]
                   for (o, _), k in zip(chunks, ("model.a", "model.b"))}
        write_metadata(path, dict_replace(md, state_dict_metadata={"model.w": entry}, storage_data=storage,
                                          planner_data={"model.w": ("model", "w")}))
        with pytest.raises(UserError, match=r"a chunk of 'model.w' lies outside it \(\[\d\] at \[-?\d\] of \[8\]\)|it keys "
                                            r"a dict by a MetadataIndex"):  # -8: refused as the storage table's key
            dcp.read(tmp_path / "two", "two")
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4, 1]))]  # sizes of another rank
    write_metadata(path, dict_replace(md, state_dict_metadata={"model.w": entry}, planner_data={"model.w": ("model", "w")},
                                      storage_data={MetadataIndex("model.w", torch.Size([0])): storage[
                                          MetadataIndex("model.w", torch.Size([0]))]}))
    with pytest.raises(UserError, match=r"a chunk of 'model.w' lies outside it"):
        dcp.read(tmp_path / "two", "two")


def by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer, order: list[str]) -> dict:
    """``optimizer.state_dict()`` keyed by parameter name (get_optimizer_state_dict's layout); ``order``: the names of
    the optimizer's parameters in its own order."""
    state = optimizer.state_dict()
    return {"state": {order[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}


def test_a_name_keyed_optimizer_state_is_numbered_by_the_models_names_and_checked_against_its_shapes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = net(1)
    names = [n for n, _ in model.named_parameters()][::-1]
    opt = torch.optim.AdamW([p for _, p in model.named_parameters()][::-1], lr=0.01)  # the saver's order: reversed
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    save_dcp("named", {"model": model.state_dict(), "optim": by_name(model, opt, names)})
    fresh = net()
    init, _ = checkpoint.start("named", fresh)
    resumed = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    checkpoint.continue_optimizer(init, resumed, "adamw")
    theirs = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(resumed.state[p]["exp_avg"], opt.state[theirs[name]]["exp_avg"]), name

    save_dcp("numbered", {"model": model.state_dict(), "optim": opt.state_dict()})  # by number, in the saver's order
    with pytest.raises(UserError, match=r"holds 'exp_avg' of shape \[3\] for parameter '0.weight' of shape \[8, 4\]"):
        checkpoint.start("numbered", net())
    other = by_name(model, opt, ["2.bias", "2.weight", "0.bias", "nope.weight"])
    save_dcp("unknown", {"model": model.state_dict(), "optim": other})
    with pytest.raises(UserError, match=r"its 'optim' holds state for 'nope.weight', no parameter of task.model"):
        checkpoint.start("unknown", net())


def test_a_file_that_changes_while_the_folder_is_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_dcp("dcp", {"model": net().state_dict()})
    read_metadata = dcp._metadata

    def then_saved_again(*args):  # another rank's save still writing: the digest would not be of what was read
        out = read_metadata(*args)
        with (tmp_path / "dcp/__0_0.distcp").open("ab") as data:
            data.write(b"more")
        return out

    monkeypatch.setattr(dcp, "_metadata", then_saved_again)
    with pytest.raises(UserError, match=r"'__0_0.distcp' changed while it was read; run again once its save has finished"):
        checkpoint.start("dcp", net())


def test_a_fifo_or_device_as_the_checkpoint_is_one_line(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    for path in ("fifo", "/dev/null"):
        with pytest.raises(UserError, match=rf"reference.checkpoint {path} is neither a file nor a folder"):
            checkpoint.start(path, net())


def _raw_metadata(tmp_path, name: str, raw: bytes):
    save_dcp(name, {"model": {"w": torch.arange(4.0)}})
    (tmp_path / name / ".metadata").write_bytes(raw)
    return tmp_path / name


@pytest.mark.parametrize(("raw", "refusal"), [
    # a dict keyed by a tuple 200,000 deep: hashing it recursed in C until the interpreter crashed (SIGSEGV)
    (b"\x80\x04}N" + b"\x85" * 200_000 + b"Ns.", r"it keys a dict by a tuple"),
    # a tuple of itself, twice, 60 deep through the memo (370 bytes): hashing it costs 2^60
    (b"\x80\x04}N\x94" + b"".join(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94" for i in range(60)) + b"Ns.",
     r"it keys a dict by a tuple"),
    # a layout named by a list: torch's _get_layout would hash whatever it is given
    (b"\x80\x04\x8c\x13torch.serialization\x94\x8c\x0b_get_layout\x94\x93]\x85R.", r"names a layout by something"),
    # Metadata made by NEWOBJ, no state set: its fields were read as attributes, a traceback
    (b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x94\x8c\x08Metadata\x94\x93)\x81.",
     r"is not readable DCP metadata \(its entries are not DCP's\)"),
    (b"\x80\x04}\x8f.", r"builds a set"),  # EMPTY_SET: DCP never pickles one
])
def test_metadata_pickles_that_hash_or_build_without_bound_are_one_line(tmp_path, monkeypatch, raw, refusal):
    """Dict keys are a str, a small int or a checked MetadataIndex; layouts and memory formats come from their names and
    numbers alone; a Metadata without its fields is refused, never read as attributes (security review, second pass)."""
    monkeypatch.chdir(tmp_path)
    folder = _raw_metadata(tmp_path, "bad", raw)
    with pytest.raises(UserError, match=refusal) as exc:
        dcp.read(folder, "bad")
    assert "\n" not in str(exc.value)


def test_a_tensor_of_a_dtype_no_checkpoint_holds_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_dcp("cplx", {"model": {"w": torch.zeros(4, dtype=torch.complex64)}})
    with pytest.raises(UserError, match=r"'model.w' is complex64 in its metadata, no dtype a model's weights"):
        dcp.read(tmp_path / "cplx", "cplx")
