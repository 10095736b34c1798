"""The chunked output store: real safetensors files, written in chunks and read by slices."""

import hashlib
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from pipeline.artifacts import outputs
from pipeline.files import write_tensors
from pipeline.errors import UserError


def _data(n=10):
    g = torch.Generator().manual_seed(0)
    return {
        "logits": torch.randn(n, 3, 5, generator=g),
        "value": torch.randn(n, 1, generator=g).double(),
        "half": torch.randn(n, 4, generator=g).to(torch.bfloat16),
        "mask": torch.rand(n, 3, generator=g) > 0.5,
    }


def _chunks(data, size):
    n = next(iter(data.values())).shape[0]
    for s in range(0, n, size):
        yield {k: v[s : s + size] for k, v in data.items()}


def test_chunked_write_equals_whole_and_is_valid_safetensors(tmp_path):
    data = _data()
    ids = [f"ordinary/{i}" for i in range(10)]
    sha3 = outputs.write_outputs(tmp_path / "a.safetensors", _chunks(data, 3), ids)
    sha10 = outputs.write_outputs(tmp_path / "b.safetensors", _chunks(data, 10), ids)
    assert sha3 == sha10 == hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    loaded = load_file(str(tmp_path / "a.safetensors"))  # the reference loader accepts it
    for k, v in data.items():
        assert torch.equal(loaded[k], v)
    # same bytes whatever the order of the keys in a chunk
    sha_rev = outputs.write_outputs(
        tmp_path / "c.safetensors", ({k: c[k] for k in reversed(list(c))} for c in _chunks(data, 4)), ids
    )
    assert sha_rev == sha3


def test_reader_slices_chunks_and_ids(tmp_path):
    data = _data(11)
    ids = [f"c{i}" for i in range(11)]
    sha = outputs.write_outputs(tmp_path / "o.safetensors", _chunks(data, 4), ids)
    r = outputs.OutputsReader(tmp_path / "o.safetensors", sha)
    assert r.names == sorted(data) and r.rows == 11 and r.ids == ids
    assert r.shape("logits") == (11, 3, 5)
    assert torch.equal(r.read("logits", 2, 7), data["logits"][2:7])
    assert r.read("value", 9, 50).shape == (2, 1)
    seen = 0
    for start, stop, chunk in r.chunks(5):
        assert torch.equal(chunk["half"], data["half"][start:stop]) and torch.equal(chunk["mask"], data["mask"][start:stop])
        seen += stop - start
    assert seen == 11
    assert all(torch.equal(v, data[k]) for k, v in r.read_all().items())


def test_reader_reads_files_of_write_tensors(tmp_path):
    data = _data(6)
    ids = [f"x/{i}" for i in range(6)]
    sha = write_tensors(tmp_path / "w.safetensors", data, {"ids": ids})
    r = outputs.OutputsReader(tmp_path / "w.safetensors", sha, "freeze")
    assert r.ids == ids and r.rows == 6
    assert torch.equal(r.read("logits", 1, 3), data["logits"][1:3])
    # and write_outputs gives the same tensors and metadata for the same content
    sha2 = outputs.write_outputs(tmp_path / "o.safetensors", [data], ids)
    r2 = outputs.OutputsReader(tmp_path / "o.safetensors", sha2)
    assert r2.meta == r.meta and all(torch.equal(r2.read(k), r.read(k)) for k in data)


def test_zero_rows_and_bad_chunks(tmp_path):
    sha = outputs.write_outputs(tmp_path / "e.safetensors", [{"o": torch.zeros(0, 3)}], [])
    r = outputs.OutputsReader(tmp_path / "e.safetensors", sha)
    assert r.rows == 0 and list(r.chunks(4)) == []
    with pytest.raises(ValueError, match="rows"):
        outputs.write_outputs(tmp_path / "f.safetensors", [{"o": torch.zeros(2, 3)}], ["a", "b", "c"])
    with pytest.raises(ValueError, match="first"):
        outputs.write_outputs(tmp_path / "f.safetensors", [{"o": torch.zeros(2, 3)}, {"o": torch.zeros(1, 4)}], ["a", "b", "c"])
    with pytest.raises(ValueError, match="no chunk"):
        outputs.write_outputs(tmp_path / "f.safetensors", [], [])
    assert not list(tmp_path.glob(".f.safetensors*")) and not (tmp_path / "f.safetensors").exists()  # nothing left behind


def test_reader_refuses_damaged_or_missing_files(tmp_path):
    p = tmp_path / "o.safetensors"
    sha = outputs.write_outputs(p, [{"o": torch.ones(4, 2)}], list("abcd"))
    with pytest.raises(UserError, match="differs from its manifest .*damaged or replaced.*dvc repro freeze"):
        outputs.OutputsReader(p, "0" * 64, "freeze")
    with pytest.raises(UserError, match="not found"):
        outputs.OutputsReader(tmp_path / "none.safetensors", sha)
    p.write_bytes(b"\x80\x04pickle-renamed")
    with pytest.raises(UserError, match="not a valid safetensors"):
        outputs.OutputsReader(p)


def test_mapped_view_equals_read_and_release_keeps_it_readable(tmp_path):
    data = _data(40)
    sha = outputs.write_outputs(tmp_path / "o.safetensors", _chunks(data, 7), [f"c{i}" for i in range(40)])
    reader = outputs.OutputsReader(tmp_path / "o.safetensors", sha)
    for name in data:
        view = reader.view(name, 5, 33)
        assert view is not None and torch.equal(view, reader.read(name, 5, 33)) and torch.equal(view, data[name][5:33])
        reader.release(name, 5, 33)
        assert torch.equal(view, data[name][5:33])  # dropped pages are read back from the file
        buffer = torch.empty(40 * data[name][0].numel(), dtype=data[name].dtype)
        assert torch.equal(reader.read(name, 0, 40, buffer), data[name]) and torch.equal(
            reader.read(name, 30, 40, buffer), data[name][30:]
        )
    assert reader.view("logits", 3, 3).shape == (0, 3, 5)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_streamed_outputs_get_the_mode_a_plain_open_gives(tmp_path, umask):
    """The reference's and trials' outputs are streamed, not written by write_bytes: same mode rule."""
    old = os.umask(umask)
    try:
        outputs.write_outputs(tmp_path / "o.safetensors", [{"output": torch.zeros(2, 3)}], ["a", "b"])
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(old)
    assert (
        stat.S_IMODE((tmp_path / "o.safetensors").stat().st_mode)
        == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
        == 0o666 & ~umask
    )
