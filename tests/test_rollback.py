"""The rollback package: restore verifies it is this variant's package of the reference on disk before loading anything."""

import json

import pytest

from pipeline import paths
from pipeline.artifacts import rollback
from pipeline.errors import UserError
from pipeline.files import sha256_file


RESTORED = (paths.REF_CHECKPOINT, paths.REF_INIT, paths.PREPARED_CASES, paths.PREPARED_TRAIN, paths.REF_CASES)
"""What a restore needs, as decide packages it."""


def _project(root):
    """A reference on disk (its five files and manifest) and bfloat16's rollback package of it, as decide writes them."""
    for i, path in enumerate(RESTORED):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(b"tensor bytes %d" % i)
    files = {str(p): sha256_file(root / p) for p in RESTORED}
    manifest = {"files": files, "rule_sha256": "a" * 64, "run_key": "b" * 64, "env": {}, "policy": {}, "real_updates": 3,
                "cases": {}, "fixed_set": {}, "roles": {}}
    (root / paths.REF_MANIFEST).write_text(json.dumps(manifest))
    package = rollback.Package("bfloat16", "a" * 64, "b" * 64, files).as_dict()
    rollback.folder("bfloat16").mkdir(parents=True)
    return package


def test_an_intact_package_is_verified(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    package = _project(tmp_path)
    (rollback.folder("bfloat16") / "manifest.json").write_text(json.dumps(package))
    assert rollback.verified_files("bfloat16") == package["files"]


CHECKPOINT = str(paths.REF_CHECKPOINT)


@pytest.mark.parametrize(
    "tamper, words",
    [  # each crashed restore in a KeyError or TypeError traceback, or passed another package's identity
        (lambda m: m["files"].pop(CHECKPOINT), "must list exactly data/reference/checkpoint.safetensors"),
        (lambda m: m.update(files={}), "must list exactly"),
        (lambda m: m.update(files=["x"]), "is not a rollback package of this version"),
        (lambda m: m["files"].update({"/etc/hostname": "0" * 64}), "must list exactly"),
        (lambda m: m["files"].update({CHECKPOINT: 5}), "a sha256 that is not 64 hexadecimal digits"),
        (lambda m: m.update(variant="float16"), "is variant 'float16''s package, not 'bfloat16''s"),
        (lambda m: m.update(rule_sha256="0" * 64), "another reference or rule than data/reference/manifest.json's"),
        (lambda m: m.update(reference_run_key="0" * 64), "another reference or rule"),
    ],
)
def test_a_tampered_package_is_refused_in_one_line(tmp_path, monkeypatch, tamper, words):
    monkeypatch.chdir(tmp_path)
    package = _project(tmp_path)
    tamper(package)
    (rollback.folder("bfloat16") / "manifest.json").write_text(json.dumps(package))
    with pytest.raises(UserError) as err:
        rollback.verified_files("bfloat16")
    assert words in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).endswith("rebuild it with `dvc repro -f decide@bfloat16`")
