"""--dump-layers on forward, decode and verify: the rows every dump of the command holds (those --rows
selects for forward; the rows that chose each token for decode; the prompt's last row and the verify rows
for verify), as computed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from metrale_cli.layer_dumps import read_layer_dump

MODEL = "tests/fixtures/models/llama"  # 2 layers, hidden 64, vocab 300


def _lm_head():
    return load_file(f"{MODEL}/model.safetensors")["lm_head.weight"].astype(np.float32)


def test_forward_layers_hold_the_rows_the_pass_computed(run_cli, tmp_path):
    d = tmp_path
    r = run_cli("forward", "-m", MODEL, "-t", "5 17 42 99 3", "--rows", "all", "--logits-dtype", "fp32",
                "--dump-layers", d / "l.safetensors", "--dump-hidden", d / "h.npy", "--dump-logits", d / "x.npy",
                "-f", "json")
    assert r.exit_code == 0, r.stderr
    dump = read_layer_dump(d / "l.safetensors")
    names = list(dump.tensors)
    assert names[0] == "model.embed_tokens" and names[-1] == "model.norm"
    assert "model.layers.1.self_attn" in names and "model.layers.1.mlp" in names and "model.layers.1" in names
    assert dump.positions == [0, 1, 2, 3, 4] and dump.tokens == [5, 17, 42, 99, 3]
    np.testing.assert_array_equal(dump.tensors["model.norm"], np.load(d / "h.npy"))
    # the logits rows are lm_head of the dumped final-norm rows, bit for bit
    np.testing.assert_array_equal(dump.tensors["model.norm"] @ _lm_head().T, np.load(d / "x.npy"))


def test_decode_layers_are_the_rows_that_chose_each_token(run_cli, tmp_path):
    r = run_cli("decode", "-m", MODEL, "-t", "5 17 42", "--steps", "4", "--ignore-eos", "--logits-dtype", "fp32",
                "--dump-layers", tmp_path / "l.npz", "--dump-hidden", tmp_path / "h.npy", "-f", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    dump = read_layer_dump(tmp_path / "l.npz")
    assert dump.positions == [2, 3, 4, 5]  # the prompt's last row, then the 3 steps fed back
    assert dump.tokens == [5, 17, 42] + [s["token"] for s in doc["steps"][:-1]]
    hidden = np.load(tmp_path / "h.npy")  # the same rows
    np.testing.assert_array_equal(dump.tensors["model.norm"], hidden)


def test_verify_layers_are_the_verify_rows_not_the_drafting_steps(run_cli, tmp_path):
    r = run_cli("verify", "-m", MODEL, "-t", "5 17 42", "--k", "3", "--logits-dtype", "fp32",
                "--dump-layers", tmp_path / "l.safetensors", "--dump-hidden", tmp_path / "h.npy", "-f", "json")
    assert r.exit_code == 0, r.stderr
    dump = read_layer_dump(tmp_path / "l.safetensors")
    # the prompt's last row, then the verify pass's rows (not the self-drafting decode steps it redid)
    assert dump.positions == [2, 3, 4, 5]
    np.testing.assert_array_equal(dump.tensors["model.norm"], np.load(tmp_path / "h.npy"))


def test_layer_selection_and_stats(run_cli, tmp_path):
    r = run_cli("forward", "-m", MODEL, "-t", "5 17 42", "--dump-layers", tmp_path / "l.safetensors",
                "--layers", "-1")
    assert r.exit_code == 0, r.stderr
    names = list(read_layer_dump(tmp_path / "l.safetensors").tensors)
    assert names == ["model.embed_tokens", "model.layers.1.self_attn", "model.layers.1.mlp", "model.layers.1",
                     "model.norm"]
    r = run_cli("forward", "-m", MODEL, "-t", "5 17 42", "--dump-layers", tmp_path / "s.json", "--dump-stats")
    assert r.exit_code == 0, r.stderr
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["rows"] == 1 and [t["name"] for t in stats["tensors"]][-1] == "model.norm"  # --rows last
    assert all(t["nan"] == 0 and t["inf"] == 0 and len(t["sha256"]) == 64 for t in stats["tensors"])


@pytest.mark.parametrize("command", [["forward"], ["forward", "--rows", "all"], ["decode", "--steps", "4"],
                                     ["verify", "--k", "3"]])
def test_every_dump_of_a_command_holds_the_same_rows(run_cli, tmp_path, command):
    d = tmp_path
    r = run_cli(*command, "-m", MODEL, "-t", "5 17 42 99", "--dump-logits", d / "x.npy", "--dump-hidden",
                d / "h.safetensors", "--dump-layers", d / "l.safetensors")
    assert r.exit_code == 0, r.stderr
    logits = json.loads((d / "x.npy.json").read_text())["positions"]
    hidden = json.loads(load_metadata(d / "h.safetensors")["positions"])
    layers = read_layer_dump(d / "l.safetensors").positions
    want = {"forward": [3], "decode": [3, 4, 5, 6], "verify": [3, 4, 5, 6]}[command[0]]
    assert logits == hidden == layers == ([0, 1, 2, 3] if "all" in command else want)


def load_metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return f.metadata()


@pytest.mark.parametrize("args, code, words", [
    (["--layers", "0"], 2, "--layers needs --dump-layers"),
    (["--dump-stats"], 2, "--dump-stats needs --dump-layers"),
    (["--dump-layers", "l.safetensors", "--layers", "5"], 5, "layer 5 does not exist"),
    (["--dump-layers", "l.txt"], 2, "--dump-layers"),
])
def test_layer_option_errors(run_cli, tmp_path, args, code, words):
    args = [str(tmp_path / a) if a.startswith("l.") else a for a in args]
    r = run_cli("forward", "-m", MODEL, "-t", "5 17 42", *args)
    assert r.exit_code == code and words in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


def test_speculative_decode_refuses_layer_dumps(run_cli, tmp_path):
    r = run_cli("decode", "-m", MODEL, "-t", "5 17 42", "--draft", "ngram", "--k", "2",
                "--dump-layers", tmp_path / "l.safetensors")
    assert r.exit_code == 2 and "plain decoding" in r.stderr
