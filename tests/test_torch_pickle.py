"""The torch-free .pt reader: files written by real torch.save (every common dtype, dicts, nesting, views
sharing one storage, the legacy format) read back bit for bit; hostile pickles refused without running;
truncated files give one clear error."""

from __future__ import annotations

import os
import pickle
import zipfile

import numpy as np
import pytest

from metrale_cli.errors import InputError
from metrale_cli.readers import torch_pickle as tp

torch = pytest.importorskip("torch")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def fresh(shape=(5, 7), dtype=torch.float32):
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(2**31)))
    x = torch.randn(shape, generator=g) * 3
    if dtype == torch.bool:
        return x > 0
    return x.to(dtype)


def as_numpy(t):
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_reads_bit_for_bit(tmp_path, dtype, legacy):
    x = fresh(dtype=dtype)
    torch.save(x, tmp_path / "x.pt", _use_new_zipfile_serialization=not legacy)
    got = tp.load(tmp_path / "x.pt")
    assert isinstance(got, tp.Tensor)
    want = as_numpy(x)
    assert got.array.dtype == want.dtype and got.array.shape == want.shape
    assert np.array_equal(got.array.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_nested_containers_and_views_sharing_one_storage(tmp_path, legacy):
    base = fresh((6, 8))
    obj = {"whole": base, "cols": base[:, 2:5], "t": base.t(), "strided": base[::2, 1::3], "row": base[3],
           "scalar": base[1, 1], "nested": {"list": [base[0], (base[5], fresh((2,), torch.bfloat16))]},
           "param": torch.nn.Parameter(fresh((3,))), "meta": {"step": 3, "name": "x", "flag": True, "none": None}}
    torch.save(obj, tmp_path / "d.pt", _use_new_zipfile_serialization=not legacy)
    got = tp.load(tmp_path / "d.pt")
    for key in ("whole", "cols", "t", "strided", "row", "scalar"):
        assert np.array_equal(got[key].array, obj[key].numpy()), key
    assert np.array_equal(got["nested"]["list"][0].array, base[0].numpy())
    assert np.array_equal(got["nested"]["list"][1][0].array, base[5].numpy())
    assert np.array_equal(got["nested"]["list"][1][1].array, obj["nested"]["list"][1][1].float().numpy())
    assert got["nested"]["list"][1][1].dtype_name == "bf16"
    assert np.array_equal(got["param"].array, obj["param"].detach().numpy())
    assert got["meta"] == {"step": 3, "name": "x", "flag": True, "none": None}


class _Hostile:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


class _Eval:
    def __reduce__(self):
        import builtins
        return (builtins.eval, ("1 + 1",))


def _as_torch_zip(path, payload: bytes):
    """A zip laid out as torch.save lays it out, whose data.pkl is `payload`."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_os_system_in_the_pickle_is_refused_and_never_run(tmp_path, legacy, run_cli):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    obj = {"logits": fresh(), "x": _Hostile(marker)}
    if legacy:
        torch.save(obj, evil, _use_new_zipfile_serialization=False)
    else:
        _as_torch_zip(evil, pickle.dumps({"x": _Hostile(marker)}, protocol=2))
    with pytest.raises(tp.UnsafePickleError) as e:
        tp.load(evil)
    assert e.value.global_name in ("posix.system", "os.system", "nt.system")
    assert "refused" in str(e.value) and e.value.global_name in str(e.value)
    assert not marker.exists()
    # through the CLI: one line, exit 5 (input error), nothing created
    np.save(tmp_path / "a.npy", fresh().numpy())
    r = run_cli("compare", tmp_path / "a.npy", evil, "--from", "torch")
    assert r.exit_code == 5, r.stderr
    assert "refused" in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_builtins_eval_and_unknown_storages_are_refused(tmp_path):
    p = tmp_path / "e.pt"
    _as_torch_zip(p, pickle.dumps([_Eval()], protocol=2))
    with pytest.raises(tp.UnsafePickleError) as e:
        tp.load(p)
    assert e.value.global_name == "builtins.eval"
    # a storage type metrale does not read is named too
    torch.save(torch.zeros(2, dtype=torch.complex64), tmp_path / "c.pt")
    with pytest.raises(tp.UnsafePickleError, match="ComplexFloatStorage"):
        tp.load(tmp_path / "c.pt")


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_truncated_files_give_one_clear_error(tmp_path, legacy):
    p = tmp_path / "t.pt"
    torch.save({"a": fresh((64, 64))}, p, _use_new_zipfile_serialization=not legacy)
    raw = p.read_bytes()
    for cut in (len(raw) // 3, len(raw) - 100, 10):
        (tmp_path / "cut.pt").write_bytes(raw[:cut])
        with pytest.raises(InputError) as e:
            tp.load(tmp_path / "cut.pt")
        assert "cut.pt" in str(e.value)
        assert not isinstance(e.value, tp.UnsafePickleError)


def test_a_view_reaching_past_its_storage_is_refused(tmp_path):
    p = tmp_path / "x.pt"
    torch.save(fresh((4, 4)), p)
    with zipfile.ZipFile(p) as z:
        members = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in members if n.endswith("data.pkl"))
    data = next(n for n in members if n.endswith("data/0"))
    members[data] = members[data][:20]  # the storage shrunk below its declared size
    with zipfile.ZipFile(p, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    with pytest.raises(InputError, match="not a complete PyTorch .pt file"):
        tp.load(p)
    assert pkl


def test_a_tensor_larger_than_its_storage_is_refused_before_any_allocation(tmp_path):
    """A hand-made pickle whose tensor claims 2^60 elements of a 4-element storage."""
    torch.save(fresh((2, 2)), tmp_path / "x.pt")
    with zipfile.ZipFile(tmp_path / "x.pt") as z:
        members = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in members if n.endswith("data.pkl"))
    huge = (2**30).to_bytes(4, "little")  # BININT operands
    patched = members[pkl].replace(b"K\x02K\x02\x86", b"J" + huge + b"J" + huge + b"\x86", 1)
    assert patched != members[pkl]
    members[pkl] = patched
    with zipfile.ZipFile(tmp_path / "x.pt", "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    with pytest.raises(InputError, match="reaches past its storage"):
        tp.load(tmp_path / "x.pt")
