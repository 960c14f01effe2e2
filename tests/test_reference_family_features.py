"""Gemma 2, Gemma 3, Phi-3 / Phi-4-mini and real sliding windows: the NumPy engine against transformers.

Goldens come from scripts/make_reference_fixtures.py (its Gemma 2/3, Phi-3 section: windows of 8, which every
12-token prompt and every 32-token greedy run crosses); tests/test_reference_live_family_features.py repeats the
comparison on freshly drawn models. Sliding layers are tested with the ring buffer wrapping (small
`pass_rows`) as well as with the default sizes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_rows import rows
from test_reference_engine import FIXTURES, golden, rel_err

from metrale_cli import decoding
from metrale_cli.backends.numpy.engine import NumpyEngine, read_weights
from metrale_cli.checkpoint import Checkpoint
from metrale_cli.config import load_config
from metrale_cli.errors import InputError
from metrale_cli.models.weights import expected_tensors

MODELS = ["gemma2", "gemma3_text", "gemma3_text_4x", "gemma3_mm", "phi3", "phi3_longrope", "phi4_mini",
          "mistral_window", "qwen3_window"]
WINDOWED = ["gemma2", "gemma3_text", "gemma3_mm", "phi3", "mistral_window", "qwen3_window"]


def engine(name: str, ctx: int = 64, pass_rows: int = 256, cfg=None, fp32: bool = True) -> NumpyEngine:
    path = FIXTURES / "models" / name
    cfg = cfg or load_config(path)
    ckpt = Checkpoint.open(path)
    return NumpyEngine(cfg, read_weights(cfg, ckpt), ctx, fp32_logits=fp32, pass_rows=pass_rows)


def prefill_rows(e: NumpyEngine, tokens) -> np.ndarray:
    n = e.prefill(list(tokens), all_logits=True)
    return rows(e, e.logits_buffer_ptr(), n)


def decode_row(e: NumpyEngine, token: int) -> np.ndarray:
    e.decode(token)
    return rows(e, e.decode_logits_ptr(), 1)[0]


# -- parity with transformers -----------------------------------------------------------------------------


@pytest.mark.parametrize("pass_rows", [256, 3], ids=["one-pass", "ring-wraps"])
@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_match_transformers(name, pass_rows):
    g = golden(name)
    e = engine(name, pass_rows=pass_rows)
    err = rel_err(prefill_rows(e, g["prompt"]), g["prefill_logits"])
    print(f"{name} pass_rows={pass_rows}: prefill max|diff|/max|ref| = {err:.2e}")
    assert err <= 1e-5
    assert rel_err(e.copy_hidden_to_host(), g["hidden_after_norm"]) <= 1e-5


@pytest.mark.parametrize("pass_rows", [256, 3], ids=["one-pass", "ring-wraps"])
@pytest.mark.parametrize("name", MODELS)
def test_32_greedy_steps_match_generate(name, pass_rows):
    g = golden(name)
    e = engine(name, pass_rows=pass_rows)
    res = decoding.run_decode(e, list(g["prompt"]), 32, keep_rows=True)
    assert [s.token for s in res.steps] == list(g["greedy_tokens"])
    err = rel_err(res.rows.array(), g["greedy_logits"])
    print(f"{name} pass_rows={pass_rows}: greedy rows max|diff|/max|ref| = {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_bf16_rows_are_the_rounding_of_the_fp32_rows(name):
    from metrale_cli.logits import bf16_bits, fp32_to_bf16

    g = golden(name)
    e16, e32 = engine(name, fp32=False), engine(name)
    n = e16.prefill(list(g["prompt"]), all_logits=True)
    bits = []
    for i in range(n):
        buf = bytearray(e16.vocab_size() * 2)
        e16.copy_logits_to_host(e16.logits_buffer_ptr().row_ptr(i), buf)
        bits.append(np.frombuffer(buf, np.uint16))
    assert np.array_equal(np.stack(bits), bf16_bits(fp32_to_bf16(prefill_rows(e32, g["prompt"]))))


# -- the fixtures exercise what they claim -------------------------------------------------------------------


@pytest.mark.parametrize("name", WINDOWED)
def test_the_window_changes_the_result(name):
    """Every window fixture crosses its window: attending to all positions instead gives other logits."""
    g = golden(name)
    cfg = load_config(FIXTURES / "models" / name)
    assert any(layer.mixer.window == 8 for layer in cfg.definition.layers)
    full = engine(name, cfg=dataclasses.replace(cfg, layer_types=()))
    assert all(layer.mixer.window is None for layer in full.cfg.definition.layers)
    assert rel_err(prefill_rows(full, g["prompt"]), g["prefill_logits"]) > 1e-3


def test_ring_buffers_are_used_where_layers_slide():
    e = engine("gemma3_text", pass_rows=3)
    windows = [layer.mixer.window for layer in e.cfg.definition.layers]
    assert windows == [8, 8, None, 8, 8, None]
    assert list(e.states["attention"].slots.values()) == [10 if w else 64 for w in windows]  # window - 1 + pass_rows, or the context
    assert list(engine("gemma3_text").states["attention"].slots.values()) == [64] * 6  # a ring no smaller than the context is not used


def test_gemma_features_matter():
    """The softcaps, the (1 + w) norm offset and the embedding scale each change the logits."""
    g = golden("gemma2")
    cfg = load_config(FIXTURES / "models" / "gemma2")
    o = cfg.options
    assert o.attn_logit_softcapping == 4.0 and o.final_logit_softcapping == 30.0
    assert cfg.definition.embed_scale == 8.0 and cfg.definition.norm.offset == 1.0
    for changed in (dataclasses.replace(o, attn_logit_softcapping=None),
                    dataclasses.replace(o, final_logit_softcapping=None),
                    dataclasses.replace(o, query_pre_attn_scalar=32.0)):
        e = engine("gemma2", cfg=dataclasses.replace(cfg, options=changed))
        assert rel_err(prefill_rows(e, g["prompt"]), g["prefill_logits"]) > 1e-4


def test_gemma3_multimodal_reads_only_the_language_model():
    cfg = load_config(FIXTURES / "models" / "gemma3_mm")
    ckpt = Checkpoint.open(FIXTURES / "models" / "gemma3_mm")
    names = set(ckpt.tensor_names())
    read = set(expected_tensors(cfg.definition))
    assert read <= names and all(n.startswith("language_model.model.") for n in read)
    assert {n.split(".")[0] for n in names - read} == {"vision_tower", "multi_modal_projector"}


def test_phi3_longrope_fixtures_sit_on_both_sides_of_the_switch():
    short = load_config(FIXTURES / "models" / "phi3_longrope").options.rope
    long = load_config(FIXTURES / "models" / "phi4_mini").options.rope
    assert short.longrope.original_max_position_embeddings == 16  # prompt 12: short; greedy crosses at 16
    assert long.longrope.original_max_position_embeddings == 8  # prompt 12: already long
    assert long.dims == 12 and long.head_dim == 16  # partial rotary 0.75
    assert abs(short.attention_scaling - 2 ** 0.5) < 1e-12  # factor 256 / 16: sqrt(1 + ln 16 / ln 16)


# -- verify, trim and the ring ---------------------------------------------------------------------------


@pytest.mark.parametrize("ring", [False, True], ids=["one-pass", "ring-wraps"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "phi3", "phi4_mini", "mistral_window", "qwen3_window"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_verify_rows_equal_sequential_decode_and_trim_equals_fresh(name, k, ring):
    # ring: passes of at most k rows, so sliding layers keep window - 1 + k slots (< the 12 + k positions
    # run) and a trim may drop exactly the k drafts
    pass_rows = k if ring else 256
    rng = np.random.default_rng()
    prompt = list(golden(name)["prompt"])
    e = engine(name, pass_rows=pass_rows)
    drafts = [int(t) for t in rng.integers(0, e.vocab_size(), k)]  # fresh random drafts each run
    e.prefill(prompt)
    seq = np.stack([decode_row(e, t) for t in drafts])
    e.reset()
    e.prefill(prompt)
    e.verify(drafts)
    assert rel_err(rows(e, e.logits_buffer_ptr(), k), seq) <= 1e-5
    keep = int(rng.integers(0, k + 1))
    e.trim(len(prompt) + keep)
    after_trim = decode_row(e, 7)
    fresh = engine(name, pass_rows=pass_rows)
    fresh.prefill(prompt + drafts[:keep])
    assert rel_err(after_trim, decode_row(fresh, 7)) <= 1e-5


def test_trim_beyond_what_a_ring_kept_is_refused():
    e = engine("gemma2", pass_rows=3)  # sliding layers: 10 slots, window 8: a trim may drop 3 positions
    e.prefill(list(range(20)))
    e.trim(17)
    e.prefill([5, 6, 7])
    with pytest.raises(InputError, match="sliding layer 0 keeps a ring of 10 positions"):
        e.trim(16)
    e.reset()  # a fresh sequence has nothing to lose
    e.prefill([1, 2])
    e.trim(0)


def test_longrope_verify_across_the_switch_is_one_call():
    """A verify pass that crosses original_max_position_embeddings runs every row with the long factors
    (as transformers' forward of the call does), over a cache recomputed with them: its rows equal a fresh
    prefill of the whole sequence. Within one side it equals sequential decoding (test above)."""
    rng = np.random.default_rng()
    prompt = list(golden("phi3_longrope")["prompt"])  # 12 positions, the switch at 16
    drafts = [int(t) for t in rng.integers(0, 300, 8)]  # positions 12..19: straddles it
    e = engine("phi3_longrope")
    e.prefill(prompt)
    e.verify(drafts)
    verified = rows(e, e.logits_buffer_ptr(), 8)
    whole = prefill_rows(engine("phi3_longrope"), prompt + drafts)[-8:]
    assert rel_err(verified, whole) <= 1e-5
    # and it differs from mixing: decoding row by row switches at the boundary
    e.reset()
    e.prefill(prompt)
    seq = np.stack([decode_row(e, t) for t in drafts])
    assert rel_err(seq[:4], verified[:4]) > 1e-3  # rows before the boundary: short factors when decoded
    assert rel_err(seq[4:], verified[4:]) <= 1e-5  # from the boundary on: long, the cache recomputed
    # trimming back below the boundary recomputes the cache short: the same as a fresh run
    e.trim(14)
    after = decode_row(e, 3)
    fresh = engine("phi3_longrope")
    fresh.prefill((prompt + drafts)[:14])
    assert rel_err(after, decode_row(fresh, 3)) <= 1e-5
