"""Checkpoint discovery: single-file and sharded round-trips, and every directory/index failure."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale_cli.checkpoint import INDEX_NAME, Checkpoint
from metrale_cli.errors import CheckpointError

# --- fixtures ------------------------------------------------------------------------------------


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(4).astype(np.float32),
        "model.norm.weight": rng.standard_normal(4).astype(np.float16),
        "lm_head.weight": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
    }


def make_single(directory: Path) -> dict[str, np.ndarray]:
    directory.mkdir(parents=True, exist_ok=True)
    ts = tensors()
    save_file(ts, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text("{}")
    return ts


# Which of the fixture tensors goes in which shard.
SHARDS = {
    "model-00001-of-00002.safetensors": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"],
    "model-00002-of-00002.safetensors": ["model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight"],
}


def make_sharded(directory: Path, weight_map: dict | None = None, index: object = None) -> dict[str, np.ndarray]:
    directory.mkdir(parents=True, exist_ok=True)
    ts = tensors()
    for shard, names in SHARDS.items():
        save_file({n: ts[n] for n in names}, str(directory / shard), metadata={"format": "pt"})
    if weight_map is None:
        weight_map = {n: shard for shard, names in SHARDS.items() for n in names}
    if index is None:
        index = {"metadata": {"total_size": sum(a.nbytes for a in ts.values())}, "weight_map": weight_map}
    text = index if isinstance(index, (str, bytes)) else json.dumps(index)
    (directory / INDEX_NAME).write_bytes(text.encode() if isinstance(text, str) else text)
    return ts


def default_map() -> dict[str, str]:
    return {n: shard for shard, names in SHARDS.items() for n in names}


# --- round trips ---------------------------------------------------------------------------------


def test_single_file_directory(tmp_path: Path) -> None:
    ts = make_single(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    with Checkpoint.open(tmp_path / "ckpt") as ck:
        assert ck.directory == tmp_path / "ckpt"
        assert ck.files == [tmp_path / "ckpt" / "model.safetensors"]
        assert ck.index_path is None
        assert sorted(ck.tensor_names()) == sorted(ts)
        assert ck.metadata == {"format": "pt"}
        assert ck.has_tokenizer
        assert ck.total_bytes == sum(a.nbytes for a in ts.values())
        assert ck.dtypes() == {"BF16": 3, "F32": 1, "F16": 1}
        for name, want in ts.items():
            assert ck.info(name).shape == want.shape
            got = ck.array(name)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
            assert not got.flags.writeable
            ck.release(name)
        assert "lm_head.weight" in ck


def test_single_file_path_looks_beside_it(tmp_path: Path) -> None:
    make_single(tmp_path / "ckpt")
    with Checkpoint.open(tmp_path / "ckpt" / "model.safetensors") as ck:
        assert ck.directory == tmp_path / "ckpt"
        assert not ck.has_tokenizer
        assert len(ck.tensor_names()) == 5


def test_sharded_directory(tmp_path: Path) -> None:
    ts = make_sharded(tmp_path / "ckpt")
    with Checkpoint.open(tmp_path / "ckpt") as ck:
        assert [p.name for p in ck.files] == list(SHARDS)
        assert ck.index_path == tmp_path / "ckpt" / INDEX_NAME
        # storage order: shard by shard
        assert ck.tensor_names()[:2] == sorted(SHARDS["model-00001-of-00002.safetensors"])
        assert sorted(ck.tensor_names()) == sorted(ts)
        for name, want in ts.items():
            assert ck.array(name).tobytes() == want.tobytes()
            assert ck.file_of(name).name in SHARDS
        assert ck.total_bytes == sum(a.nbytes for a in ts.values())


def test_index_path_as_argument_and_single_preferred(tmp_path: Path) -> None:
    make_sharded(tmp_path / "ckpt")
    with Checkpoint.open(tmp_path / "ckpt" / INDEX_NAME) as ck:
        assert len(ck.files) == 2
    save_file({"only": np.zeros(1, np.float32)}, str(tmp_path / "ckpt" / "model.safetensors"))
    with Checkpoint.open(tmp_path / "ckpt") as ck:  # like transformers: model.safetensors wins
        assert ck.tensor_names() == ["only"]


def test_hub_cache_symlinks_into_blobs_are_allowed(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    make_sharded(tmp_path / "src")
    for i, name in enumerate([*SHARDS, INDEX_NAME]):
        (blobs / f"blob{i}").write_bytes((tmp_path / "src" / name).read_bytes())
        (snap / name).symlink_to(Path("../../blobs") / f"blob{i}")
    with Checkpoint.open(snap) as ck:
        assert len(ck.tensor_names()) == 5


def test_unknown_tensor_name(tmp_path: Path) -> None:
    make_single(tmp_path / "c")
    with Checkpoint.open(tmp_path / "c") as ck, pytest.raises(CheckpointError, match="did you mean 'lm_head.weight'"):
        ck.info("lm_head.weights")


# --- failures ------------------------------------------------------------------------------------


def _bad_index(text: str | bytes) -> Callable[[Path], Path]:
    def build(root: Path) -> Path:
        make_sharded(root / "ckpt", index=text)
        return root / "ckpt"

    return build


def _bad_map(mutate: Callable[[dict], None]) -> Callable[[Path], Path]:
    def build(root: Path) -> Path:
        wm = default_map()
        mutate(wm)
        make_sharded(root / "ckpt", weight_map=wm)
        return root / "ckpt"

    return build


def _dir_with(*names: str) -> Callable[[Path], Path]:
    def build(root: Path) -> Path:
        (root / "ckpt").mkdir()
        for name in names:
            (root / "ckpt" / name).write_bytes(b"\x00" * 16)
        return root / "ckpt"

    return build


def _extra_tensor_in_shard(root: Path) -> Path:
    make_sharded(root / "ckpt")
    shard = root / "ckpt" / "model-00002-of-00002.safetensors"
    ts = tensors()
    save_file({**{n: ts[n] for n in SHARDS[shard.name]}, "stray.bias": np.ones(2, np.float32)}, str(shard))
    return root / "ckpt"


def _tensor_in_two_shards(root: Path) -> Path:
    make_sharded(root / "ckpt")
    shard = root / "ckpt" / "model-00002-of-00002.safetensors"
    ts = tensors()
    save_file({n: ts[n] for n in [*SHARDS[shard.name], "model.embed_tokens.weight"]}, str(shard))
    return root / "ckpt"


def _symlink_outside(root: Path) -> Path:
    wm = default_map()
    wm["lm_head.weight"] = "linked.safetensors"
    make_sharded(root / "ckpt", weight_map=wm)
    save_file({"lm_head.weight": tensors()["lm_head.weight"]}, str(root / "outside.safetensors"))
    (root / "ckpt" / "linked.safetensors").symlink_to(root / "outside.safetensors")
    return root / "ckpt"


def _corrupt_shard(root: Path) -> Path:
    make_sharded(root / "ckpt")
    shard = root / "ckpt" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes() + b"junk")
    return root / "ckpt"


def _lfs_shard(root: Path) -> Path:
    make_sharded(root / "ckpt")
    (root / "ckpt" / "model-00001-of-00002.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 12\n"
    )
    return root / "ckpt"


def _file(name: str) -> Callable[[Path], Path]:
    def build(root: Path) -> Path:
        (root / name).write_bytes(b"\x00" * 16)
        return root / name

    return build


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda wm: wm.__setitem__(key, value)


# id -> (build the checkpoint under tmp_path and return the path to open, message substring, name to find)
FAILURES: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    "path-missing": (lambda root: root / "absent", "checkpoint path does not exist", "absent"),
    "dir-empty": (_dir_with(), "no weights found", "ckpt"),
    "dir-pytorch-bin": (_dir_with("pytorch_model.bin", "config.json"), "pytorch_model.bin, a weights format metrale cannot read", "ckpt"),
    "dir-one-other-safetensors": (_dir_with("consolidated.safetensors"), "found consolidated.safetensors: pass that file's path", "ckpt"),
    "dir-safetensors-no-index": (_dir_with("a.safetensors", "b.safetensors"), "but no model.safetensors.index.json", "ckpt"),
    "file-pytorch-bin": (_file("pytorch_model.bin"), "PyTorch pickle weights", "pytorch_model.bin"),
    "file-other": (_file("weights.txt"), "not a checkpoint directory", "weights.txt"),
    "index-not-utf8": (_bad_index(b'{"weight_map": {"\xff": "x"}}'), "shard index is not valid UTF-8", INDEX_NAME),
    "index-not-json": (_bad_index('{"weight_map": '), "shard index is not valid JSON", INDEX_NAME),
    "index-not-object": (_bad_index("[]"), "shard index is not a JSON object", INDEX_NAME),
    "index-no-weight-map": (_bad_index('{"metadata": {}}'), "shard index has no weight_map", INDEX_NAME),
    "index-weight-map-list": (_bad_index('{"weight_map": []}'), "weight_map is not an object", INDEX_NAME),
    "index-weight-map-empty": (_bad_index('{"weight_map": {}}'), "weight_map is empty", INDEX_NAME),
    "index-weight-map-value": (_bad_map(_set("lm_head.weight", 3)), "weight_map entry 'lm_head.weight' is not a shard file name", INDEX_NAME),
    "index-duplicate-key": (_bad_index('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}'), "key 'a' appears twice", INDEX_NAME),
    "shard-missing": (_bad_map(_set("lm_head.weight", "model-00003-of-00003.safetensors")), "shard 'model-00003-of-00003.safetensors' (for tensor 'lm_head.weight') does not exist", INDEX_NAME),
    "shard-parent-dir": (_bad_map(_set("lm_head.weight", "../outside.safetensors")), "leaves the checkpoint directory", INDEX_NAME),
    "shard-absolute": (_bad_map(_set("lm_head.weight", "/etc/passwd")), "is an absolute path", INDEX_NAME),
    "shard-empty-name": (_bad_map(_set("lm_head.weight", "")), "is not a valid file name", INDEX_NAME),
    "shard-symlink-outside": (_symlink_outside, "resolves outside the checkpoint directory", INDEX_NAME),
    "tensor-in-wrong-shard": (_bad_map(_set("lm_head.weight", "model-00001-of-00002.safetensors")), "places tensor 'lm_head.weight' in model-00001-of-00002.safetensors, but that shard does not hold it (it is in model-00002", INDEX_NAME),
    "tensor-in-no-shard": (_bad_map(_set("ghost.weight", "model-00001-of-00002.safetensors")), "places tensor 'ghost.weight' in model-00001-of-00002.safetensors, but that shard does not hold it", INDEX_NAME),
    "tensor-not-in-index": (_bad_map(lambda wm: wm.pop("model.norm.weight")), "holds tensor 'model.norm.weight', which the index does not list", INDEX_NAME),
    "tensor-in-two-shards": (_tensor_in_two_shards, "tensor 'model.embed_tokens.weight' is stored in two shards", INDEX_NAME),
    "tensor-stray-in-shard": (_extra_tensor_in_shard, "holds tensor 'stray.bias', which the index does not list", INDEX_NAME),
    "shard-corrupt": (_corrupt_shard, "trailing bytes after the last tensor", "model-00002-of-00002.safetensors"),
    "shard-git-lfs": (_lfs_shard, "Git LFS pointer", "model-00001-of-00002.safetensors"),
}


@pytest.mark.parametrize("case", list(FAILURES), ids=list(FAILURES))
def test_checkpoint_failure(tmp_path: Path, case: str) -> None:
    build, needle, culprit = FAILURES[case]
    path = build(tmp_path)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(path)
    message = str(info.value)
    assert needle in message
    assert culprit in message
    assert "\n" not in message and info.value.exit_code == 3


def test_failed_open_leaves_no_mapping_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_cli import checkpoint, safetensors_file

    opened: list[safetensors_file.SafetensorsFile] = []
    real_open = safetensors_file.SafetensorsFile.open.__func__  # type: ignore[attr-defined]

    def spy(cls: type, path: os.PathLike[str]) -> safetensors_file.SafetensorsFile:
        f = real_open(cls, path)
        opened.append(f)
        return f

    monkeypatch.setattr(checkpoint.SafetensorsFile, "open", classmethod(spy))
    _bad_map(lambda wm: wm.pop("model.norm.weight"))(tmp_path)
    with pytest.raises(CheckpointError):
        Checkpoint.open(tmp_path / "ckpt")
    assert len(opened) == 2 and all(f.closed for f in opened)
