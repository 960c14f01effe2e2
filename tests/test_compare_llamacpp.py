"""`metrale compare` against llama.cpp's own outputs, made by the real tools (tests/fixtures/llamacpp/, by
scripts/make_llamacpp_fixtures.py; VERSION.txt names the llama.cpp build): llama-eval-callback's printed
nodes for a statistics comparison, llama-debug --save-logits' logits, both on metrale's embedded default
model and prompt; planted differences found by layer and position; llama.cpp's q/k row order."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.readers import llamacpp

FIX = Path(__file__).resolve().parent / "fixtures" / "llamacpp"
CALLBACK = FIX / "eval-callback.txt"
PROMPT = "The for statement"
TAPS = {"model.embed_tokens", "model.norm"} | {f"model.layers.{i}{s}" for i in range(5)
                                                for s in ("", ".mlp", ".self_attn")}
LAST_ONLY = {"model.layers.4.mlp", "model.layers.4", "model.norm"}  # llama.cpp keeps the last row after attention


def as_json(r):
    return json.loads(r.stdout)


@pytest.fixture
def metrale_dump(run_cli, tmp_path):
    r = run_cli("forward", "--prompt", PROMPT, "--rows", "all", "--device", "cpu",
                "--dump-layers", tmp_path / "a.safetensors", "--dump-logits", tmp_path / "a.npy")
    assert r.exit_code == 0, r.stderr
    return tmp_path / "a.safetensors"


def test_eval_callback_output_is_parsed_and_mapped():
    cb = llamacpp.read_eval_callback(CALLBACK, "B")
    assert cb.tokens == [0, 341, 343, 455]
    assert TAPS <= set(cb.taps)
    node = cb.taps["model.layers.2"]
    assert node.name == "l_out-2" and node.ne == (192, 4, 1, 1) and node.edges.shape == (1, 1, 4, 6)
    assert cb.taps["model.layers.0.self_attn.q_rope"].op == "ROPE" and cb.taps["model.layers.0.self_attn.q_proj"].op \
        == "MUL_MAT" and cb.taps["model.layers.1.self_attn.o_proj.input"].name == "kqv_out-1"
    assert all(cb.taps[t].ne[1] == 1 for t in LAST_ONLY) and not cb.notes


def test_statistics_comparison_with_metrale_passes(run_cli, metrale_dump):
    doc = as_json(run_cli("compare", metrale_dump, CALLBACK, "--rtol", "1e-5", "-f", "json"))
    assert doc["kind"] == "stats" and doc["statistics_only"] is True and doc["passed"] is True
    assert TAPS <= {t["name"] for t in doc["tensors"]}
    for t in doc["tensors"]:
        assert abs(t["sum_a"] - t["sum_b"]) <= t["sum_tol"] and t["edge_max_diff"] <= t["edge_tol"], t
    plain = run_cli("compare", metrale_dump, CALLBACK, "-f", "plain").stdout
    assert "statistics comparison: B (llama.cpp eval-callback) holds each node's sum and edge values" in plain


def _replace_value(text: str, node: str, row: int, new: float) -> str:
    """The eval-callback text with the first printed value of `row` (a token) of `node` replaced."""
    lines = text.splitlines(keepends=True)
    start = next(k for k, line in enumerate(lines) if re.search(rf"\b{re.escape(node)} = \(", line))
    rows = [k for k in range(start + 1, len(lines)) if lines[k].lstrip().startswith("[") and "." in lines[k]]
    k = rows[row]
    lines[k] = re.sub(r"-?\d+\.\d+", f"{new:12.4f}".strip(), lines[k], count=1)
    return "".join(lines)


def test_planted_edge_value_is_found_by_layer_and_position(run_cli, metrale_dump, tmp_path):
    text = CALLBACK.read_text()
    (tmp_path / "b.txt").write_text(_replace_value(text, "ffn_out-2", 1, 9.0))
    r = run_cli("compare", metrale_dump, tmp_path / "b.txt", "--rtol", "1e-3", "-f", "plain")
    assert r.exit_code == 9, r.stderr
    assert "first divergence: model.layers.2.mlp (ffn_out-2) at position 1: " in r.stdout
    assert "edge values differ by" in r.stdout


def test_planted_sum_is_found(run_cli, metrale_dump, tmp_path):
    text = CALLBACK.read_text()
    lines = text.splitlines(keepends=True)
    start = next(k for k, line in enumerate(lines) if re.search(r"\bl_out-3 = \(", line))
    k = next(j for j in range(start, len(lines)) if "sum = " in lines[j])
    total = float(lines[k].split("=")[1])
    lines[k] = lines[k].replace(lines[k].split("=")[1].strip(), f"{total + 5.0:f}")
    (tmp_path / "b.txt").write_text("".join(lines))
    doc = as_json(run_cli("compare", metrale_dump, tmp_path / "b.txt", "-f", "json"))
    assert doc["first_divergence"] == {"name": "model.layers.3", "node": "l_out-3", "position": None}


def test_dump_stats_sums_against_llamacpp(run_cli, tmp_path):
    r = run_cli("forward", "--prompt", PROMPT, "--rows", "all", "--device", "cpu", "--dump-layers",
                tmp_path / "s.json", "--dump-stats")
    assert r.exit_code == 0, r.stderr
    doc = as_json(run_cli("compare", tmp_path / "s.json", CALLBACK, "--rtol", "1e-3", "-f", "json"))
    assert doc["passed"] is True and "A holds statistics only: compared the sums" in doc["what"]
    assert all(t["edges"] == 0 for t in doc["tensors"]) and {t["name"] for t in doc["tensors"]} == TAPS - LAST_ONLY


def test_llama_debug_logits_against_metrale(run_cli, metrale_dump, tmp_path):
    doc = as_json(run_cli("compare", tmp_path / "a.npy", FIX / "debug", "--max-kl", "1e-6", "--max-rel-err", "1e-4",
                          "-f", "json"))
    assert doc["passed"] is True and doc["rows"] == 1 and doc["by_position"][0]["position"] == 3
    assert doc["only_a_positions"] == [0, 1, 2]


def test_other_tokens_are_an_input_error(run_cli, tmp_path):
    r = run_cli("forward", "--prompt", "The for loop", "--rows", "all", "--device", "cpu",
                "--dump-layers", tmp_path / "a.safetensors")
    assert r.exit_code == 0, r.stderr
    r = run_cli("compare", tmp_path / "a.safetensors", CALLBACK)
    assert r.exit_code == 5 and "ran different tokens from position" in r.stderr, r.stderr


def test_output_cut_at_the_end_leaves_that_node_out_and_says_so(run_cli, metrale_dump, tmp_path):
    """llama.cpp's logger can lose the printout's tail at exit: the node it ends inside is left out, noted."""
    text = CALLBACK.read_text()
    cut = text.index("[", text.index("[", text.index("l_out-4 = (")) + 1) + 40  # inside that node's values
    (tmp_path / "b.txt").write_text(text[:cut])
    r = run_cli("compare", metrale_dump, tmp_path / "b.txt", "-f", "plain")
    assert r.exit_code == 0, r.stderr
    assert "note (b): the output ends inside node l_out-4" in r.stdout
    assert "model.layers.4 " not in r.stdout.split("only_in_a:")[0] and "ffn_out-4" in r.stdout


def test_damaged_eval_callback_output_is_one_clear_error(run_cli, metrale_dump, tmp_path):
    lines = CALLBACK.read_text().splitlines(keepends=True)
    k = next(j for j, line in enumerate(lines) if "ffn_out-1 = (" in line) + 3
    del lines[k]  # one printed row gone in the middle
    (tmp_path / "b.txt").write_text("".join(lines))
    r = run_cli("compare", metrale_dump, tmp_path / "b.txt")
    assert r.exit_code == 5 and "node ffn_out-1" in r.stderr and "damaged" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_q_and_k_are_compared_in_the_converters_row_order():
    """convert_hf_to_gguf.py permutes each q/k weight's rows: reshape(heads, 2, hd/2, ...).swapaxes(1, 2)."""
    rng = np.random.default_rng()
    heads, hd, hidden, tokens = 3, 8, 24, 5
    w = rng.standard_normal((heads * hd, hidden))
    x = rng.standard_normal((tokens, hidden))
    w_gguf = w.reshape(heads, 2, hd // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert np.allclose(llamacpp.to_llamacpp_layout(x @ w.T, hd), x @ w_gguf.T, rtol=0, atol=1e-12)


def test_the_fixture_says_how_it_was_made():
    version = (FIX / "VERSION.txt").read_text()
    assert "llama.cpp:" in version and "make_llamacpp_fixtures.py" in version
    assert (FIX / "debug" / "llamacpp-default-f32-prompt.txt").read_text().splitlines()[2] == \
        "token ids: 0, 341, 343, 455"


def test_finer_taps_from_transformers_match_llamacpp_nodes_through_its_row_order(tmp_path):
    """transformers' q/k/v projections, rope outputs, norms and MLP parts of the default model (the taps
    metrale does not dump yet) against llama.cpp's Qcur/Kcur/..., compared in llama.cpp's q/k row order."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib.util

    from metrale_cli import layer_dumps as ld
    from metrale_cli.compare import DEFAULT_RTOL, Side
    from metrale_cli.compare_stats import compare_stats

    spec = importlib.util.spec_from_file_location("engine_dumps", FIX.parents[2] / "scripts" / "engine_dumps.py")
    dumps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dumps)
    tokens = [0, 341, 343, 455]
    h = dumps.hf_modules(FIX.parents[2] / "metrale_cli" / "assets" / "models" / "default", tokens)
    parts = {"input_layernorm": "n1", "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
             "self_attn.q_rope": "q_rope", "self_attn.k_rope": "k_rope", "self_attn.o_proj.input": "attn",
             "post_attention_layernorm": "n2", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
             "mlp.down_proj.input": "act"}
    taps = {f"model.layers.{i}.{tap}": h[f"{i}.{key}"].numpy() for i in range(5) for tap, key in parts.items()}
    dump = ld.LayerDump(tmp_path, {n: taps[n] for n in ld.forward_order(list(taps))}, list(range(4)), tokens)
    cb = llamacpp.read_eval_callback(CALLBACK, "B")
    r = compare_stats(dump, cb, 1e-4, (Side("a", "transformers", None, None), Side("b", "llama.cpp", None, None)),
                      DEFAULT_RTOL)
    compared = {t.name for t in r.tensors}
    assert {f"model.layers.{i}.{tap}" for i in range(4) for tap in parts} <= compared
    assert r.first_divergence is None, r.divergence_line()
    # without the permutation the q projection's printed values do not match
    q = r.tensors[[t.name for t in r.tensors].index("model.layers.0.self_attn.q_proj")]
    node = cb.taps["model.layers.0.self_attn.q_proj"]
    plain = llamacpp.edges_of(llamacpp.tap_view(taps["model.layers.0.self_attn.q_proj"].astype(np.float64), node), node)
    assert np.abs(plain - node.edges).max() > 100 * q.edge_max_diff
