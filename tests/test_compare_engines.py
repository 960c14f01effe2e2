"""`metrale compare` against other engines' dumps: vLLM's intermediate logging and SGLang's tensor dump
across two TP ranks and two forward steps (values from transformers, laid out by scripts/engine_dumps.py),
SGLang's dumper files and generic .pt files with --map, TensorRT-LLM's logits .npy; each against metrale
on the same checkpoint, with a planted difference named by layer and position."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.compare_inputs import ReadOptions, read_input
from metrale_cli.errors import InputError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("engine_dumps", REPO / "scripts" / "engine_dumps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_dumps = _script()
fresh_tokens, hf_modules, write_sglang, write_vllm = (_dumps.fresh_tokens, _dumps.hf_modules, _dumps.write_sglang,
                                                      _dumps.write_vllm)

LLAMA = "tests/fixtures/models/llama"
T = 7
METRALE_TAPS = {"model.embed_tokens", "model.norm"} | {f"model.layers.{i}{s}" for i in range(2)
                                                       for s in ("", ".self_attn", ".mlp")}
FINE = {f"model.layers.{i}.{s}" for i in range(2) for s in (
    "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.q_rope", "self_attn.k_rope", "self_attn.o_proj.input", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj.input")}


@pytest.fixture(scope="module")
def hf():
    tokens = fresh_tokens(T, 300)
    return tokens, hf_modules(LLAMA, tokens)


@pytest.fixture
def metrale_dump(run_cli, tmp_path, hf):
    tokens, _ = hf
    r = run_cli("forward", "-m", LLAMA, "-t", " ".join(map(str, tokens)), "--rows", "all", "--device", "cpu",
                "--dump-layers", tmp_path / "a.safetensors", "--dump-logits", tmp_path / "a.npy")
    assert r.exit_code == 0, r.stderr
    return tmp_path / "a.safetensors"


STEPS = [slice(0, T - 1), slice(T - 1, T)]  # a prefill of T-1 tokens, then one decode step


def as_json(r):
    return json.loads(r.stdout)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_dump_over_two_tp_ranks_matches_metrale(run_cli, tmp_path, hf, metrale_dump, engine):
    tokens, h = hf
    if engine == "vllm":
        b = write_vllm(tmp_path / "vllm", h, tokens, 2, STEPS)
        extra = ["--from", "vllm", "--model", LLAMA]
    else:
        write_sglang(tmp_path / "sgl", h, tokens, 2, STEPS)
        b, extra = tmp_path / "sgl", []  # by content; q, k and v widths from the rope outputs
    doc = as_json(run_cli("compare", metrale_dump, b, *extra, "--rtol", "1e-4", "-f", "json"))
    names = {t["name"] for t in doc["tensors"]}
    assert names == METRALE_TAPS, names
    assert set(doc["only_in_b"]) == FINE
    assert doc["passed"] is True and doc["positions"] == list(range(T))
    assert max(float(t["rel_err"]) for t in doc["tensors"]) < 1e-5
    # the fused and sharded outputs, joined and split, are transformers' q, k, v, gate, up bit for bit
    dump = read_input(b, "B", ReadOptions(fmt_b=engine, model=LLAMA))
    for i in range(2):
        for tap, key in (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"),
                         ("mlp.gate_proj", "gate"), ("mlp.up_proj", "up"), ("self_attn.q_rope", "q_rope"),
                         ("mlp.down_proj.input", "act"), ("input_layernorm", "n1")):
            assert np.array_equal(dump.tensors[f"model.layers.{i}.{tap}"], h[f"{i}.{key}"].numpy()), tap
    assert dump.tokens == tokens


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_planted_difference_is_named_by_layer_and_position(run_cli, tmp_path, hf, metrale_dump, engine):
    tokens, h = hf
    if engine == "vllm":
        b = write_vllm(tmp_path / "vllm", h, tokens, 2, STEPS)
        f = b / "step_0" / "model.layers.1.mlp" / "outputs_cuda_0.pt"
        x = torch.load(f)
        x[3] += 0.05 * x[3].abs().max()
        torch.save(x, f)
        shutil.copy(f, f.with_name("outputs_cuda_1.pt"))
    else:
        b = tmp_path / "sgl"
        for d in write_sglang(b, h, tokens, 2, STEPS):  # the row-parallel down_proj output on every rank
            obj = torch.load(d / "Pass00000.pt")
            obj["model.layers.1.mlp.down_proj"][3] += 0.05 * obj["model.layers.1.mlp.down_proj"][3].abs().max()
            torch.save(obj, d / "Pass00000.pt")
    r = run_cli("compare", metrale_dump, b, "--model", LLAMA, "--rtol", "1e-4", "-f", "plain")
    assert r.exit_code == 9, r.stderr
    assert "first divergence: model.layers.1.mlp at position 3" in r.stdout
    doc = as_json(run_cli("compare", metrale_dump, b, "--model", LLAMA, "-f", "json"))
    assert doc["first_divergence"]["name"] == "model.layers.1.mlp" and doc["first_divergence"]["position"] == 3
    assert [p["first_exceeding"] for p in doc["by_position"]] == [None] * 3 + ["model.layers.1.mlp"] + [None] * 3


def test_engine_logits_against_metrale_logits(run_cli, tmp_path, hf, metrale_dump):
    tokens, h = hf
    b = write_vllm(tmp_path / "vllm", h, tokens, 2, STEPS)
    doc = as_json(run_cli("compare", tmp_path / "a.npy", b, "--model", LLAMA, "--max-kl", "1e-6", "-f", "json"))
    assert doc["passed"] is True and doc["rows"] == 2  # the last row of each step
    assert [p["position"] for p in doc["by_position"]] == [T - 2, T - 1]


def test_different_token_ids_are_an_input_error(run_cli, tmp_path, hf, metrale_dump):
    tokens, h = hf
    b = write_vllm(tmp_path / "vllm", h, tokens, 1, STEPS)
    f = b / "step_0" / "model.embed_tokens" / "inputs_0_cuda_0.pt"
    ids = torch.load(f)
    ids[2] = (ids[2] + 1) % 300
    torch.save(ids, f)
    r = run_cli("compare", metrale_dump, b, "--model", LLAMA)
    assert r.exit_code == 5 and "different tokens from position 2" in r.stderr


def test_fused_qkv_without_config_or_rope_is_refused_by_name(tmp_path, hf):
    tokens, h = hf
    b = write_vllm(tmp_path / "vllm", h, tokens, 1, STEPS)
    for d in b.glob("step_*/model.layers.0.self_attn.rotary_emb*"):
        shutil.rmtree(d)
    with pytest.raises(InputError, match="qkv_proj#0 is q, k and v fused: give --model"):
        read_input(b, "B", ReadOptions())


def test_unknown_tensor_differing_between_ranks_asks_for_a_rule(tmp_path, hf):
    tokens, h = hf
    d0, d1 = tmp_path / "r0", tmp_path / "r1"
    for d, k in ((d0, 0), (d1, 1)):
        d.mkdir()
        torch.save({"custom.out": torch.full((3, 4), float(k + 1))}, d / "ops.pt")
    with pytest.raises(InputError, match="custom.out differs between TP ranks 0 and 1"):
        read_input(d0, "B", ReadOptions(fmt_b="torch", tp_dirs=[str(d0), str(d1)]))
    (tmp_path / "m.json").write_text(json.dumps({"map": [{"pattern": r"custom\.out", "name": "x",
                                                          "tp": "column"}]}))
    got = read_input(d0, "B", ReadOptions(fmt_b="torch", tp_dirs=[str(d0), str(d1)], map_file=str(tmp_path / "m.json")))
    assert got.tensors["x"].shape == (3, 8) and got.tensors["x"][0, 5] == 2


def test_sglang_dumper_files_with_a_toml_map(run_cli, tmp_path, hf, metrale_dump):
    tokens, h = hf
    d = tmp_path / "sglang_dump_1733_0"
    d.mkdir()
    for i in range(2):
        for name, key in (("attn_out", f"{i}.attn_out"), ("hidden_after", f"{i}.layer")):
            f = d / f"step=0___rank=0___dump_index={3 * i}___name={name}___layer_id={i}.pt"
            torch.save({"value": h[key], "meta": {"name": name, "layer_id": i, "rank": 0}}, f)
    (tmp_path / "m.toml").write_text(
        "[[map]]\npattern = 'model\\.layers\\.(\\d+)\\.attn_out'\nname = 'model.layers.{1}.self_attn'\n"
        "[[map]]\npattern = 'model\\.layers\\.(\\d+)\\.hidden_after'\nname = 'model.layers.{1}'\n")
    doc = as_json(run_cli("compare", metrale_dump, d, "--from", "sglang", "--map", tmp_path / "m.toml", "-f", "json"))
    assert {t["name"] for t in doc["tensors"]} == {f"model.layers.{i}{s}" for i in range(2) for s in ("", ".self_attn")}
    assert max(float(t["rel_err"]) for t in doc["tensors"]) < 1e-5


def test_map_split_and_slice_on_a_pt_dict(tmp_path, hf):
    _, h = hf
    fused = torch.cat([h["0.q"], h["0.k"], h["0.v"]], -1)
    torch.save({"blk.0.qkv": fused, "blk.0.wide": torch.cat([h["0.n1"], h["0.n1"]], -1)}, tmp_path / "ops.pt")
    (tmp_path / "m.json").write_text(json.dumps({"map": [
        {"pattern": r"blk\.(\d+)\.qkv", "names": ["model.layers.{1}.q", "model.layers.{1}.k", "model.layers.{1}.v"],
         "split": [64, 32, 32]},
        {"pattern": r"blk\.(\d+)\.wide", "name": "model.layers.{1}.input_layernorm", "slice": [0, 64]}]}))
    got = read_input(tmp_path / "ops.pt", "B", ReadOptions(map_file=str(tmp_path / "m.json")))
    assert np.array_equal(got.tensors["model.layers.0.k"], h["0.k"].numpy())
    assert np.array_equal(got.tensors["model.layers.0.input_layernorm"], h["0.n1"].numpy())


@pytest.mark.parametrize("bad, words", [
    ({"map": [{"name": "x"}]}, "needs a 'pattern'"),
    ({"map": [{"pattern": "(", "name": "x"}]}, "not a regular expression"),
    ({"map": [{"pattern": "a", "names": ["x", "y"]}]}, "need a 'split'"),
    ({"map": [{"pattern": "a", "name": "x", "tp": "row"}]}, "'tp' is"),
    ({"map": [{"pattern": "a", "name": "x", "stride": 2}]}, "unknown key 'stride'"),
])
def test_bad_map_files_are_usage_errors(run_cli, tmp_path, bad, words):
    torch.save({"a": torch.randn(2, 3)}, tmp_path / "x.pt")
    (tmp_path / "m.json").write_text(json.dumps(bad))
    r = run_cli("compare", tmp_path / "x.pt", tmp_path / "x.pt", "--map", tmp_path / "m.json")
    assert r.exit_code == 2 and words in r.stderr, r.stderr


def test_trtllm_logits_npy_against_metrale_decode(run_cli, tmp_path, hf):
    tokens, h = hf
    r = run_cli("decode", "-m", LLAMA, "-t", " ".join(map(str, tokens[:4])), "--steps", 3, "--device", "cpu",
                "--dump-logits", tmp_path / "m.npy", "-f", "json")
    assert r.exit_code == 0, r.stderr
    rows = np.load(tmp_path / "m.npy")
    noise = np.random.default_rng().standard_normal(rows.shape).astype(np.float32) * 1e-4
    np.save(tmp_path / "trt.npy", (rows + noise)[None, None])  # [batch 1, beam 1, steps, vocab]
    doc = as_json(run_cli("compare", tmp_path / "m.npy", tmp_path / "trt.npy", "--from", "trtllm", "-f", "json"))
    assert doc["rows"] == rows.shape[0] and doc["top1"]["rate"] == 1.0
    assert 0 < float(doc["overall"]["max_abs_diff"]) < 1e-3


def test_rich_report_draws_the_error_by_position(run_cli, tmp_path, hf, metrale_dump):
    tokens, h = hf
    _dumps.perturb(h_copy := dict(h), "model.layers.0.self_attn", 4)
    b = write_vllm(tmp_path / "vllm", h_copy, tokens, 1, STEPS)
    r = run_cli("compare", metrale_dump, b, "-f", "rich", env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("max rel err by position"))
    bars = line.rsplit(": ", 1)[1]
    assert line.startswith(f"max rel err by position 0..{T - 1}, max ") and len(bars) == T
    assert bars[4] == "█" and " at 4:" in line  # the planted position is the tallest bar
    r = run_cli("compare", tmp_path / "a.npy", b, "-f", "rich", env={"COLUMNS": "100"})
    assert any(x.startswith(f"KL by position {T - 2}..{T - 1}") for x in r.stdout.splitlines()), r.stdout


def test_sparkline_heights_are_on_a_log_scale():
    from metrale_cli.render.compare import sparkline

    assert sparkline([1e-8, 1e-6, 1e-4, 0.0, float("nan")]) == "▁▅█▁!"
    assert sparkline([0.0, 0.0]) == "▁▁"


@pytest.mark.parametrize("args, code, words", [
    (["--from", "llamacpp"], 5, "neither llama-eval-callback output"),
    (["--from", "onnx"], 2, "--from takes vllm, sglang"),
    (["--from", "safetensors"], 5, "--from safetensors reads .safetensors files, not '.npy'"),
])
def test_format_choice_errors(run_cli, tmp_path, args, code, words):
    np.save(tmp_path / "a.npy", np.random.default_rng().standard_normal((2, 5)).astype(np.float32))
    r = run_cli("compare", tmp_path / "a.npy", tmp_path / "a.npy", *args)
    assert r.exit_code == code and words in r.stderr, r.stderr


def test_a_folder_of_nothing_known_is_one_input_error(run_cli, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    np.save(tmp_path / "a.npy", np.random.default_rng().standard_normal((2, 5)).astype(np.float32))
    r = run_cli("compare", tmp_path / "a.npy", tmp_path / "d")
    assert r.exit_code == 5 and "not a dump metrale reads" in r.stderr, r.stderr


def test_vllm_ranks_in_separate_folders_with_tp_dirs(run_cli, tmp_path, hf, metrale_dump):
    tokens, h = hf
    both = write_vllm(tmp_path / "both", h, tokens, 2, STEPS)
    dirs = []
    for r in range(2):  # each rank's files in its own run folder, as separate processes write them
        d = tmp_path / f"rank{r}"
        for f in both.rglob(f"*_cuda_{r}.pt"):
            dest = d / f.relative_to(both)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)
        dirs.append(d)
    doc = as_json(run_cli("compare", metrale_dump, "--tp-dirs", f"{dirs[0]},{dirs[1]}", "--from", "vllm",
                          "--rtol", "1e-4", "-f", "json"))
    assert doc["passed"] is True and {t["name"] for t in doc["tensors"]} == METRALE_TAPS
    dump = read_input(dirs[0], "B", ReadOptions(fmt_b="vllm", tp_dirs=[str(d) for d in dirs]))
    assert np.array_equal(dump.tensors["model.layers.1.mlp.gate_proj"], h["1.gate"].numpy())


def test_engine_dump_as_the_reference_with_from_a(run_cli, tmp_path, hf, metrale_dump):
    tokens, h = hf
    a = write_sglang(tmp_path / "sgl", h, tokens, 1, STEPS)[0]  # one rank's folder of passes
    doc = as_json(run_cli("compare", a, metrale_dump, "--from-a", "sglang", "--rtol", "1e-4", "-f", "json"))
    assert doc["passed"] is True and doc["a"]["source"] == "SGLang tensor dump"
    assert {t["name"] for t in doc["tensors"]} == METRALE_TAPS and set(doc["only_in_a"]) == FINE


def test_sglang_last_token_only_dump_compares_the_last_positions(run_cli, tmp_path, hf, metrale_dump):
    """TENSOR_DUMP_LAST_TOKEN_ONLY=1: each pass keeps its last row, at the last of its positions."""
    tokens, h = hf
    d = write_sglang(tmp_path / "sgl", h, tokens, 1, STEPS)[0]
    for f in sorted(d.glob("Pass*.pt")):
        obj = torch.load(f)
        torch.save({k: (v if "forward_batch_info" in k else [x[-1:] for x in v] if isinstance(v, list) else v[-1:])
                    for k, v in obj.items()}, f)
    doc = as_json(run_cli("compare", metrale_dump, d, "--rtol", "1e-4", "-f", "json"))
    assert doc["passed"] is True and doc["positions"] == [T - 2, T - 1]
    assert {t["name"] for t in doc["tensors"]} == METRALE_TAPS


def test_the_readmes_map_example_does_what_it_says(tmp_path):
    import re

    toml = re.search(r"```toml\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    (tmp_path / "names.toml").write_text(toml)
    rng = np.random.default_rng()
    q, k, v = (torch.tensor(rng.standard_normal((3, w)), dtype=torch.float32) for w in (2048, 512, 512))
    out = torch.tensor(rng.standard_normal((3, 64)), dtype=torch.float32)
    dirs = []
    for r in range(2):  # two TP ranks, each with its half of q, k and v
        d = tmp_path / f"rank{r}"
        d.mkdir()
        torch.save({"blk.0.out": out, "blk.0.qkv": torch.cat([x.chunk(2, -1)[r] for x in (q, k, v)], -1)},
                   d / "ops.pt")
        dirs.append(str(d))
    got = read_input(dirs[0], "B", ReadOptions(fmt_b="torch", tp_dirs=dirs, map_file=str(tmp_path / "names.toml")))
    assert np.array_equal(got.tensors["model.layers.0.self_attn.k_proj"], k.numpy())
    assert np.array_equal(got.tensors["model.layers.0"], out.numpy())


def test_head_shaped_column_shards_join_by_heads():
    """Qwen3's q_norm output per rank is [tokens, heads/tp, head_dim]: the whole is rank 0's heads, then rank 1's."""
    from metrale_cli.readers.names import Config, Raw, resolve

    x = np.random.default_rng().standard_normal((5, 4, 8)).astype(np.float32)  # 4 heads of 8
    raw = Raw({"model.layers.0.self_attn.q_norm": [x[:, :2], x[:, 2:]]})
    got = resolve(raw, [], True, Config(), "B").taps["model.layers.0.self_attn.q_norm"]
    assert np.array_equal(got, x.reshape(5, 32))


def test_one_rope_output_under_every_layers_name_is_left_out_with_a_note(run_cli, tmp_path, hf, metrale_dump):
    tokens, h = hf
    shared = dict(h, **{"0.q_rope": h["1.q_rope"], "0.k_rope": h["1.k_rope"]})  # the last call's, as SGLang records
    b = write_sglang(tmp_path / "sgl", shared, tokens, 1, STEPS)[0]
    r = run_cli("compare", metrale_dump, b, "-f", "plain")
    assert r.exit_code == 0, r.stderr
    assert "note (b): q_rope/k_rope left out: every layer's name holds the same output" in r.stdout
    assert "q_rope" not in r.stdout.split("only_in_b:")[1].split("\n")[0]


def test_sglang_pipeline_stages_join_their_layers(run_cli, tmp_path, hf, metrale_dump):
    """Two pipeline stages of two TP ranks each (layer 0 and the embedding on PP0, layer 1 and the norm on
    PP1): every tap is found once, as one stage holding every layer would give it; a planted difference on
    the second stage is named by layer and position."""
    tokens, h = hf
    dirs = write_sglang(tmp_path / "sgl", h, tokens, 2, STEPS, pp=2)
    assert sorted(d.name.split("_pid")[0] for d in dirs) == ["TP0_PP0_Rank0", "TP0_PP1_Rank2", "TP1_PP0_Rank1",
                                                             "TP1_PP1_Rank3"]
    assert not any("model.layers.1" in k for k in torch.load(dirs[0] / "Pass00000.pt"))
    doc = as_json(run_cli("compare", metrale_dump, tmp_path / "sgl", "--rtol", "1e-4", "-f", "json"))
    assert {t["name"] for t in doc["tensors"]} == METRALE_TAPS and set(doc["only_in_b"]) == FINE
    assert doc["passed"] is True and max(float(t["rel_err"]) for t in doc["tensors"]) < 1e-5
    for d in dirs[2:]:  # PP1's ranks: the row-parallel down_proj output of layer 1
        obj = torch.load(d / "Pass00001.pt")
        obj["model.layers.1.mlp.down_proj"][0] += 0.05 * obj["model.layers.1.mlp.down_proj"][0].abs().max()
        torch.save(obj, d / "Pass00001.pt")
    doc = as_json(run_cli("compare", metrale_dump, tmp_path / "sgl", "--rtol", "1e-4", "-f", "json"))
    assert doc["first_divergence"]["name"] == "model.layers.1.mlp" and doc["first_divergence"]["position"] == T - 1


def test_sglang_pipeline_stages_that_disagree_are_input_errors(tmp_path, hf):
    tokens, h = hf
    dirs = write_sglang(tmp_path / "sgl", h, tokens, 1, STEPS, pp=2)
    obj = torch.load(dirs[1] / "Pass00000.pt")
    obj["model.forward_batch_info.input_ids"][1] += 1
    torch.save(obj, dirs[1] / "Pass00000.pt")
    with pytest.raises(InputError, match="pipeline stages 0 and 1 ran different token ids in step 0"):
        read_input(tmp_path / "sgl", "B", ReadOptions(fmt_b="sglang", model=LLAMA))
    shutil.rmtree(tmp_path / "sgl")
    dirs = write_sglang(tmp_path / "sgl", h, tokens, 2, STEPS, pp=2)
    shutil.rmtree(dirs[-1])  # PP1 lost a TP rank
    with pytest.raises(InputError, match="different numbers of TP ranks"):
        read_input(tmp_path / "sgl", "B", ReadOptions(fmt_b="sglang", model=LLAMA))


@pytest.mark.parametrize("block", ["mlp", "block_sparse_moe"])
def test_moe_router_logits_and_block_outputs_from_engine_names(run_cli, tmp_path, block):
    """A MoE model's router (`mlp.gate`: vLLM's ReplicatedLinear, a (logits, None) output; Mixtral's
    `block_sparse_moe.gate` in vLLM) and its block output map to metrale's router-logits tap and MLP output:
    values from transformers' qwen3_moe (the router logits: the gate's own output, captured by a hook)."""
    name = "tests/fixtures/models/qwen3_moe"
    tokens = fresh_tokens(6, 300)
    a = tmp_path / "a.safetensors"
    r = run_cli("forward", "-m", name, "-t", " ".join(map(str, tokens)), "--rows", "all", "--device", "cpu",
                "--dump-layers", a)
    assert r.exit_code == 0, r.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="eager", experts_implementation="eager")
    model = model.float().eval()
    captured = {}
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    assert sparse, "the fixture has sparse layers"
    for i in sparse:
        def keep(module, args, out, i=i):
            captured[i] = args[0].reshape(-1, args[0].shape[-1]) @ module.gate.weight.T, out
        model.model.layers[i].mlp.register_forward_hook(keep)
    with torch.no_grad():
        model(torch.tensor([tokens]))
    step = tmp_path / "vllm" / "step_0"
    for i, (logits, out) in captured.items():
        out = out[0] if isinstance(out, tuple) else out
        for module, file, value in ((f"{block}.gate", "outputs_0_cuda_0.pt", logits),
                                    (block, "outputs_cuda_0.pt", out.reshape(len(tokens), -1))):
            d = step / f"model.layers.{i}.{module}"
            d.mkdir(parents=True)
            torch.save(value.detach().clone(), d / file)
    doc = as_json(run_cli("compare", a, tmp_path / "vllm", "--from", "vllm", "--rtol", "1e-4", "-f", "json"))
    compared = {t["name"]: float(t["rel_err"]) for t in doc["tensors"]}
    assert set(compared) == {f"model.layers.{i}.mlp{s}" for i in sparse for s in ("", ".gate")}, compared
    assert max(compared.values()) < 1e-5 and doc["passed"] is True
