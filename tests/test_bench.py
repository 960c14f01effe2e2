"""`metrale bench` on the CPU engine with the tiny preset: every figure is measured and reported."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.bench import preset_path, run_bench
from metrale_cli.cli import main
from metrale_cli.errors import UsageError


def test_run_bench_cpu_measures_every_figure():
    r = run_bench("tiny-llama", device="cpu", context=32, ks=(1, 4), prefill_tokens=32, repeats=3)
    names = [f.name for f in r.figures]
    assert names[:4] == ["read bandwidth", "decode floor", "GEMM rate", "decode step"]
    assert {"verify k=1", "verify k=4", "prefill 32"} <= set(names)
    for f in r.figures:
        assert f.value > 0, f
    step = r.get("decode step")
    assert step.ratio == pytest.approx(step.value / r.get("decode floor").value)
    assert r.get("verify k=4").met is not None  # k=4 is held to its target


def test_bench_cli_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", "--preset", "tiny-llama", "--context", "16", "--prefill", "16",
              "--repeats", "2", "--ks", "2", "--format", "json", "--json", str(out)])
    assert e.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["preset"] == "tiny-llama" and printed["device"] == "cpu"


def test_a_checkpoint_directory_is_a_preset(tmp_path):
    """bench --preset DIR reads DIR/config.json, as --preset DIR/config.json does."""
    (tmp_path / "config.json").write_text(preset_path("tiny-llama").read_text())
    assert preset_path(str(tmp_path)) == tmp_path / "config.json"
    with pytest.raises(UsageError, match="unknown preset"):
        preset_path(str(tmp_path / "missing"))


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(UsageError, match="llama-3.1-8b"):
        preset_path("gpt-5")


@pytest.mark.parametrize("args, code", [(["--ks", "a,b"], 2), (["--context", "0"], 2), (["--prefill", "0"], 2),
                                        (["--repeats=-1"], 2), (["--ks", "0"], 2), (["--path", "rows,fused"], 2),
                                        (["--path", ","], 2)])
def test_bench_bad_options(args, code, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", *args])
    assert e.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_path_names_are_checked():
    from metrale_cli.bench import check_paths

    assert check_paths(None, "cpu") is None
    assert check_paths(("rows", "Fused", "rows"), "cuda") == ("rows", "fused")
    with pytest.raises(UsageError, match="choose from rows, fused"):
        check_paths(("rows", "persistent"), "cuda")
    with pytest.raises(UsageError, match="--device cuda"):
        check_paths(("fused",), "cpu")


def _paths_result():
    from metrale_cli.bench import BenchResult, Figure, PathResult

    res = BenchResult("llama-3.1-8b", "cuda", 1024, 8030261248, 15011946496, 134217728)
    res.figures = [Figure("decode floor", 3.436, "ms", "weights + KV bytes / read bandwidth")]
    res.paths = [PathResult("rows", 4.954, 1.4418, 0.6936, {"4": 5.3, "8": 5.52}, {"4": 1.0698, "8": 1.1143}),
                 PathResult("fused", 4.5, 1.3097, 0.7636, {"4": 4.9, "8": 5.1}, {"4": 1.0889, "8": 1.1333},
                            0.0625, True, {"qkv_rope": "a reason"})]
    return res


def test_bench_renders_the_paths_side_by_side_in_plain_and_json():
    import io

    from rich.console import Console

    from metrale_cli import render

    res = _paths_result()
    buf = io.StringIO()
    render.render_bench(Console(file=buf, width=80, color_system=None), "plain", res)
    lines = buf.getvalue().splitlines()
    i = lines.index("rows paths side by side (same run; verify: x that path's decode step):")
    assert lines[i + 1:i + 8] == [
        "decode step: rows 4.954 ms | fused 4.500 ms",
        "x floor: rows 1.442 | fused 1.310",
        "of read bandwidth: rows 69.4% | fused 76.4%",
        "verify k=4: rows 5.300 ms (1.070 x) | fused 4.900 ms (1.089 x)",
        "verify k=8: rows 5.520 ms (1.114 x) | fused 5.100 ms (1.133 x)",
        "logits vs rows: rows  | fused max |diff| 6.250e-02, argmax same",
        "unfused: rows  | fused qkv_rope: a reason",
    ]
    data = res.to_json()
    assert data["paths"][1] == {"path": "fused", "decode_ms": 4.5, "floor_ratio": 1.3097, "bandwidth_fraction": 0.7636,
                                "verify_ms": {"4": 4.9, "8": 5.1}, "verify_ratio": {"4": 1.0889, "8": 1.1333},
                                "logits_max_abs_diff": 0.0625, "argmax_matches": True,
                                "fallbacks": {"qkv_rope": "a reason"}}
    assert run_bench("tiny-llama", device="cpu", context=8, ks=(1,), prefill_tokens=8, repeats=1).paths == []


@pytest.mark.parametrize("width", [80, 120])
def test_bench_paths_table_fits(width):
    import io

    from rich.cells import cell_len
    from rich.console import Console

    from metrale_cli import render

    buf = io.StringIO()
    render.render_bench(Console(file=buf, width=width, color_system=None), "rich", _paths_result())
    text = buf.getvalue()
    assert "rows paths side by side" in text and "fused" in text
    assert all(cell_len(line) <= width for line in text.splitlines())


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b", "llama-3.1-8b-nvfp4", "qwen3-8b-fp8",
                                    "llama-3.1-8b-w4a16"])
def test_quantized_presets_draw_weights_of_the_linear_size(preset, tmp_path):
    """The quantized presets' random weights, drawn by their formats (MXFP4 experts, ModelOpt NVFP4, packed int4)
    at a small size with the preset's config: every value finite and the weights' spread near fan_in^-0.5 (the size the
    dense presets draw), so a bench or a CPU run computes on realistic numbers."""
    from metrale_cli.config import load_config
    from metrale_cli.models import formats
    from metrale_cli.random_weights import RandomTensors

    cfg = json.loads(preset_path(preset).read_text())
    small = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 256, "vocab_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 4,
             "layer_types": ["sliding_attention", "full_attention"]}
    cfg.update({k: v for k, v in small.items() if k in cfg or k == "head_dim"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = load_config(tmp_path)
    source = RandomTensors(config, seed=3)
    drawn, ratios = 0, []
    for p in config.definition.params():
        if p.format is None:
            continue
        fmt = formats.weight_format(p.format)
        for t, value in zip(p.parts, formats.dequantize(p, source.array)):
            assert np.isfinite(value).all()
            ratio = float(value.std()) * t.shape[-1] ** 0.5
            assert 0.4 < ratio < 2.5, (fmt.name, t.name, ratio)
            ratios.append(ratio)
            drawn += 1
    assert drawn >= 2
    print(f"{preset}: std x fan_in^0.5 of the drawn weights {min(ratios):.2f}..{max(ratios):.2f}")


@pytest.mark.parametrize("fused_min", [0, None])
def test_the_cpu_floor_counts_the_bytes_the_engine_holds(monkeypatch, fused_min):
    """The CPU engine keeps BF16 projections as stored (2 bytes) where its kernels take them and widens the rest
    to fp32 (4 bytes), norms in fp32: the floor's weight bytes are those, the embedding table left out."""
    from metrale_cli.backends.numpy import kernels
    from metrale_cli.backends.numpy.engine import load_numpy_engine
    from metrale_cli.floors import weight_bytes
    from metrale_cli.checkpoint import Checkpoint
    from metrale_cli.config import load_config

    if fused_min is not None:
        monkeypatch.setattr(kernels, "FUSED_MIN", fused_min)
    path = Path(__file__).parent / "fixtures" / "models" / "llama_bf16"
    cfg, ckpt = load_config(path), Checkpoint.open(path)
    eng = load_numpy_engine(cfg, ckpt, 16)
    streamed, _ = weight_bytes(eng, cfg, 4)
    want = 0
    for name in ckpt.tensor_names():
        info = ckpt.info(name)
        if name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            continue
        n = int(np.prod(info.shape))
        want += 2 * n if (info.dtype == "BF16" and len(info.shape) == 2 and fused_min == 0) else 4 * n
    assert streamed == want


def test_the_formats_note_says_what_the_floor_counts_on_each_engine():
    """On the GPU the floor counts MXFP4 experts and FP8 projections as the bytes the engine holds (the checkpoint's
    e2m1 codes and E8M0 scales; e4m3 and fp32 scales), and a format's weight dequantized at load as bf16 (DeepSeek-V3's
    FP8 latent projections); on the CPU the engine's own arrays (stored, or fp32 where it dequantizes)."""
    from metrale_cli.bench import preset_path
    from metrale_cli.floors import weight_formats_note
    from metrale_cli.config import load_config

    oss, fp8 = load_config(preset_path("gpt-oss-20b")), load_config(preset_path("qwen3-8b-fp8"))
    held = "the bytes the engine holds them in (packed weights and their scales)"
    assert weight_formats_note(oss, "cuda").endswith(held) and weight_formats_note(fp8, "cuda").endswith(held)
    assert weight_formats_note(load_config(preset_path("deepseek-v3")), "cuda").endswith(
        "bf16 for kv_a, kv_b, q_a, q_b (dequantized at load), the packed weights and scales of the rest")
    assert "fp32 copies where it dequantizes at load" in weight_formats_note(oss, "cpu")
    assert weight_formats_note(load_config(preset_path("llama-3.1-8b")), "cuda") is None


def test_a_preset_too_big_for_this_machines_memory_is_refused_before_drawing(monkeypatch, capsys):
    """The CPU bench draws its random weights into memory: a preset whose stored bytes alone (a lower bound of what
    the NumPy engine holds) exceed the memory available is refused at once (exit 8, one line), not run out of
    memory; one that fits, or a machine whose available memory is unknown, goes on."""
    from metrale_cli import bench
    from metrale_cli.config import load_config
    from metrale_cli.errors import DeviceError

    with pytest.raises(DeviceError, match=r"need at least 626\.9 GiB of memory and this machine has 24\.0 GiB"):
        bench.check_cpu_fits(load_config(preset_path("deepseek-v3")), 24 << 30)
    bench.check_cpu_fits(load_config(preset_path("llama-3.1-8b-nvfp4")), 24 << 30)  # 5.6 GiB stored
    bench.check_cpu_fits(load_config(preset_path("deepseek-v3")), None)
    monkeypatch.setattr(bench, "available_memory", lambda: 1 << 30)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", "--preset", "llama-3.1-8b", "--no-transformers"])
    assert e.value.code == 8
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the progress line, the error on one line
    assert last.startswith("metrale: device error: the random weights need at least 15.0 GiB") and "Traceback" not in err
