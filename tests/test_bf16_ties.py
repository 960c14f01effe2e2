"""Default greedy is the reference's: on the CPU the logits default to fp32, so greedy equals fp32 greedy
(transformers' fp32 greedy). A bf16 row whose argmax is a tie, or whose fp32 argmax differs, says so in
every format. The model here is built so that the prompt's last row holds two logits, 16.91 at id LOW and
16.93 at id HIGH, that both round to bf16 16.875: bf16 picks LOW (the lower id), fp32 picks HIGH."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.decoding.decode import run_decode, run_forward
from metrale_cli.model import open_model

PROMPT = [1, 2, 3]
LOW, HIGH = 5, 9


@pytest.fixture(scope="module")
def tie_model(tmp_path_factory) -> Path:
    from tests.conftest import edit_tensors, random_llama

    model = random_llama(tmp_path_factory.mktemp("tie") / "m", hidden=64, heads=4, kv_heads=2, intermediate=128,
                         vocab=256, max_positions=64, seed=3)
    m = open_model(model, device="cpu", max_context=len(PROMPT), fp32_logits=True)
    try:
        m.engine.prefill(PROMPT)
        h = m.engine.copy_hidden_to_host().astype(np.float64)
    finally:
        m.close()

    def edit(t: dict[str, np.ndarray]) -> None:  # every logit of the prompt's last row 0 but LOW and HIGH
        head = np.zeros_like(t["lm_head.weight"], dtype=np.float64)
        head[LOW], head[HIGH] = h * 16.91 / (h @ h), h * 16.93 / (h @ h)
        t["lm_head.weight"] = head.astype(np.float32)

    edit_tensors(model, edit)
    return model


def test_the_numpy_engine_gives_the_fp32_argmax_of_its_bf16_rows(tie_model):
    m = open_model(tie_model, device="cpu", max_context=8, fp32_logits=False)
    try:
        e = m.engine
        e.prefill(PROMPT, all_logits=True)
        last = e.logits_buffer_ptr().row_ptr(len(PROMPT) - 1)
        assert e.argmax_on_device(last) == LOW and e.fp32_argmax(last) == HIGH
        e.decode(HIGH)
        decoded = e.fp32_argmax(e.decode_logits_ptr())
        assert e.fp32_argmax(last) == HIGH  # each buffer keeps its own rows' answers
    finally:
        m.close()
    fp32 = open_model(tie_model, device="cpu", max_context=8, fp32_logits=True)
    try:
        fp32.engine.prefill(PROMPT)
        assert fp32.engine.fp32_argmax(fp32.engine.logits_buffer_ptr()) is None  # fp32 rows: their own argmax
        fp32.engine.decode(HIGH)
        assert decoded == fp32.engine.argmax_on_device(fp32.engine.decode_logits_ptr())
    finally:
        fp32.close()


def test_rows_carry_the_note(tie_model):
    m = open_model(tie_model, device="cpu", max_context=8, fp32_logits=False)
    try:
        row = run_forward(m.engine, PROMPT, all_rows=False).rows[0]
        step = run_decode(m.engine, PROMPT, 1).steps[0]
    finally:
        m.close()
    for r in (row, step):
        assert r.note is not None and r.note.tied == [LOW, HIGH] and r.note.fp32_argmax == HIGH


def _args(model: Path, *more) -> list:
    return ["-m", model, "-t", " ".join(map(str, PROMPT)), *more]


def test_the_cpu_default_is_fp32_greedy(run_cli, tie_model):
    default = json.loads(run_cli("decode", *_args(tie_model, "--steps", 6, "--ignore-eos", "-f", "json")).stdout)
    fp32 = json.loads(run_cli("decode", *_args(tie_model, "--steps", 6, "--ignore-eos", "-f", "json",
                                              "--logits-dtype", "fp32")).stdout)
    bf16 = json.loads(run_cli("decode", *_args(tie_model, "--steps", 6, "--ignore-eos", "-f", "json",
                                              "--logits-dtype", "bf16")).stdout)
    assert default["logits_dtype"] == "fp32" and default["steps"] == fp32["steps"]
    assert default["steps"][0]["token"] == HIGH and default["steps"][0]["argmax_note"] is None
    assert bf16["steps"][0]["token"] == LOW
    assert bf16["steps"][0]["argmax_note"] == {"tied": [LOW, HIGH], "fp32_argmax": HIGH}


def test_the_embedded_models_cpu_default_is_fp32_greedy(run_cli):
    runs = [json.loads(run_cli("decode", "--steps", 24, "--ignore-eos", "-f", "json", *dtype).stdout)
            for dtype in ([], ["--logits-dtype", "fp32"])]
    assert runs[0]["logits_dtype"] == "fp32" and runs[0]["steps"] == runs[1]["steps"]


NOTE = "[bf16 tie 5=9, lowest wins; fp32 argmax 9]"


@pytest.mark.parametrize("command", ["decode", "forward", "verify"])
def test_every_format_says_so(run_cli, tie_model, command):
    extra = {"decode": ["--steps", 1], "forward": [], "verify": ["--k", 1]}[command]
    base = [command, *_args(tie_model, *extra, "--logits-dtype", "bf16")]
    plain = run_cli(*base, "-f", "plain").stdout
    assert NOTE in plain, plain
    doc = json.loads(run_cli(*base, "-f", "json").stdout)
    rows = doc["steps"] if command == "decode" else doc["rows"]
    assert rows[0]["argmax_note"] == {"tied": [LOW, HIGH], "fp32_argmax": HIGH}
    rich = run_cli(*base, "-f", "rich", env={"COLUMNS": "80"}).stdout
    assert "tie 5=9, fp32 9" in rich and "(the lowest wins)" in " ".join(rich.split())
    assert max(len(line) for line in rich.splitlines()) <= 80
