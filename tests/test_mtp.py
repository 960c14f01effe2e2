"""The multi-token-prediction (MTP) layer (models/mtp.py, engine/mtp.py) and its draft (decode --draft mtp).

The fixtures deepseek_v3_mtp and glm4_moe_mtp are the base fixtures plus one MTP layer drawn and read back by
transformers' own MtpModel (scripts/make_mtp_fixtures.py); their goldens hold transformers' MTP logits for every
position of the prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_rows import rel, rows
from metrale_cli.backends.numpy.engine import load_numpy_engine
from metrale_cli.backends.numpy.mtp import load_numpy_mtp
from metrale_cli.checkpoint import Checkpoint
from metrale_cli.config import load_config
from metrale_cli.decoding.decode import run_decode
from metrale_cli.decoding.speculative import MtpDrafter, speculative_decode
from metrale_cli.errors import CheckpointError, ConfigError
from metrale_cli.models.mtp import mtp_config

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ["deepseek_v3_mtp", "glm4_moe_mtp"]


def engines(name: str, ctx: int = 96, mla: str = "naive"):
    d = FIXTURES / "models" / name
    cfg, ckpt = load_config(d), Checkpoint.open(d)
    return (load_numpy_engine(cfg, ckpt, ctx, fp32_logits=True, mla=mla),
            load_numpy_mtp(cfg, ckpt, ctx, fp32_logits=True, mla=mla))


@pytest.mark.parametrize("name, mla", [("deepseek_v3_mtp", "naive"), ("deepseek_v3_mtp", "absorbed"),
                                       ("glm4_moe_mtp", "naive")])  # GLM-4.5: attention, one algebra
def test_mtp_rows_match_transformers(name, mla):
    """Every prompt position's MTP logits (and the normed rows behind them) against transformers' MtpModel,
    fed the golden's main-model hidden rows; and the main model's hidden rows against the golden's."""
    g = np.load(FIXTURES / "golden" / f"{name}.npz")
    target, mtp = engines(name, mla=mla)
    prompt = [int(t) for t in g["prompt"]]
    target.prefill(prompt, all_logits=True)
    herr = rel(target.copy_hidden_rows_to_host(), g["hidden_after_norm"])
    n = mtp.run(prompt[1:], g["hidden_after_norm"][:-1], all_logits=True)
    got = rows(mtp, mtp.logits_buffer_ptr(), n)
    err = float(np.max(np.abs(got - g["mtp_logits"])) / np.max(np.abs(g["mtp_logits"])))
    hid = rel(mtp.copy_hidden_rows_to_host(), g["mtp_hidden"])
    print(f"{name} ({mla}): MTP logits rel err {err:.2e}, its rows {hid:.2e}; main hidden rows {herr:.2e}")
    assert err < 1e-5 and hid < 1e-5 and herr < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_mtp_in_pieces_equals_one_pass(name):
    """Fresh tokens and hidden rows fed in pieces (the cache, its positions from 1) give the one pass's rows."""
    rng = np.random.default_rng()
    _, mtp = engines(name)
    n = 17
    tokens = [int(t) for t in rng.integers(0, mtp.cfg.vocab_size, n)]
    previous = rng.standard_normal((n, mtp.cfg.hidden_size)).astype(np.float32)
    mtp.run(tokens, previous, all_logits=True)
    whole = rows(mtp, mtp.logits_buffer_ptr(), n)
    mtp.reset()
    got, cuts = [], [0, 5, 6, 7, 12, n]
    for a, b in zip(cuts, cuts[1:]):
        m = mtp.run(tokens[a:b], previous[a:b], all_logits=True)
        got.append(rows(mtp, mtp.logits_buffer_ptr(), m))
    assert rel(np.concatenate(got), whole) < 1e-5
    mtp.trim(6)  # a trimmed cache runs the same rows again
    m = mtp.run(tokens[6:], previous[6:], all_logits=True)
    assert rel(rows(mtp, mtp.logits_buffer_ptr(), m), whole[6:]) < 1e-5


def test_the_previous_rows_and_the_token_both_count():
    """Neither input is ignored: another hidden row, or another token, moves the MTP's logits."""
    rng = np.random.default_rng()
    _, mtp = engines("deepseek_v3_mtp")
    tokens = [int(t) for t in rng.integers(0, 300, 6)]
    previous = rng.standard_normal((6, 64)).astype(np.float32)

    def last(tok, prev):
        mtp.reset()
        mtp.run(tok, prev)
        return rows(mtp, mtp.logits_buffer_ptr(), 1)[0]

    base = last(tokens, previous)
    assert rel(last(tokens, previous + rng.standard_normal(previous.shape).astype(np.float32)), base) > 1e-2
    assert rel(last(tokens[:-1] + [(tokens[-1] + 1) % 300], previous), base) > 1e-2


class CheckedDrafter(MtpDrafter):
    """MtpDrafter whose every proposal is checked against the MTP layer run from scratch on the committed tokens
    with a fresh target's hidden rows (and each further draft on the layer's own last row); then, so that
    verify passes accept drafts, the first `good` drafts are replaced by the target's greedy tokens."""

    def __init__(self, mtp, target, fresh_target, fresh_mtp, greedy, rng):
        super().__init__(mtp, target)
        self.fresh_target, self.fresh_mtp, self.greedy, self.rng = fresh_target, fresh_mtp, greedy, rng
        self.errors: list[float] = []

    def propose(self, committed, k):
        drafts = super().propose(committed, k)
        ft, fm = self.fresh_target, self.fresh_mtp
        ft.reset()
        ft.prefill(committed[:-1], all_logits=True)
        fm.reset()
        fm.run(committed[1:], ft.copy_hidden_rows_to_host())
        for d in drafts:
            want = rows(fm, fm.logits_buffer_ptr(), 1)[0]
            assert d == int(np.argmax(want))
            fm.run([d], fm.copy_hidden_rows_to_host()[-1:])
        good = int(self.rng.integers(0, len(drafts) + 1))
        at = len(committed)
        return [self.greedy[at + j] if j < good else d for j, d in enumerate(drafts)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", NAMES)
def test_mtp_drafts_are_the_layers_and_decoding_stays_greedy(name, k):
    """decode --draft mtp: every draft is the MTP layer's argmax on the committed tokens (state fed across
    accepted and rejected drafts, checked from scratch at each pass), and the tokens are plain greedy's."""
    rng = np.random.default_rng()
    target, mtp = engines(name)
    fresh_target, fresh_mtp = engines(name)
    prompt = [int(t) for t in rng.integers(0, 300, 7)]
    steps = 20
    plain = [s.token for s in run_decode(target, prompt, steps + k).steps]  # k more: the last pass's good drafts
    drafter = CheckedDrafter(mtp, target, fresh_target, fresh_mtp, prompt + plain, rng)
    result = speculative_decode(target, drafter, prompt, steps, k)
    assert [s.token for s in result.steps] == plain[:steps]
    assert result.stats.accepted > 0 and result.stats.draft_source == "mtp"


def test_refusals_name_what_is_missing(tmp_path):
    cfg = load_config(FIXTURES / "models" / "qwen3_moe")
    with pytest.raises(ConfigError, match="qwen3_moe has no multi-token-prediction layer"):
        mtp_config(cfg)
    import json

    from metrale_cli.config import parse_config

    raw = json.loads((FIXTURES / "models" / "deepseek_v3_mtp" / "config.json").read_text())
    with pytest.raises(ConfigError, match="no sparse layer"):  # every decoder layer dense: no experts' sizes
        mtp_config(parse_config(dict(raw, first_k_dense_replace=raw["num_hidden_layers"])))
    d = FIXTURES / "models" / "deepseek_v3"  # declares one MTP layer; its checkpoint holds none
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.eh_proj\.weight is missing"):
        load_numpy_mtp(load_config(d), Checkpoint.open(d), 32)


def test_decode_draft_mtp_on_the_command_line(run_cli):
    """metrale decode --draft mtp: the tokens of plain decoding, the drafts counted under draft_source mtp;
    refusals with their exit codes (no MTP family 4, no MTP tensors 3, a GPU device or an unknown source 2)."""
    import json

    model, tokens = "tests/fixtures/models/glm4_moe_mtp", "[5, 17, 99, 3, 250]"
    plain = run_cli("decode", "--model", model, "--tokens", tokens, "--steps", 9, "--format", "json")
    spec = run_cli("decode", "--model", model, "--tokens", tokens, "--steps", 9, "--format", "json",
                   "--draft", "mtp", "--k", 3)
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert [s["token"] for s in b["steps"]] == [s["token"] for s in a["steps"]]
    assert b["speculative"]["draft_source"] == "mtp" and b["speculative"]["drafted"] > 0
    r = run_cli("decode", "--model", "tests/fixtures/models/qwen3_moe", "--tokens", "[1, 2]", "--draft", "mtp")
    assert r.exit_code == 4 and "no multi-token-prediction layer" in r.stderr
    r = run_cli("decode", "--model", "tests/fixtures/models/deepseek_v3", "--tokens", "[1, 2]", "--draft", "mtp")
    assert r.exit_code == 3 and "model.layers.3.eh_proj.weight is missing" in r.stderr
    r = run_cli("decode", "--model", model, "--tokens", "[1, 2]", "--draft", "mtp", "--draft-model", model)
    assert r.exit_code == 2 and "exclusive" in r.stderr
    r = run_cli("decode", "--model", model, "--tokens", "[1, 2]", "--draft", "eagle")
    assert r.exit_code == 2 and "'ngram' or 'mtp'" in r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_forward_mtp_dumps_transformers_rows(name, run_cli, tmp_path):
    """metrale forward --mtp --rows all --dump-logits: transformers' MTP logits, positions 1..T-1, the dump saying
    what its rows are."""
    from safetensors import safe_open

    g = np.load(FIXTURES / "golden" / f"{name}.npz")
    out = tmp_path / "mtp.safetensors"
    r = run_cli("forward", "--model", f"tests/fixtures/models/{name}", "--tokens", " ".join(map(str, g["prompt"])),
                "--rows", "all", "--mtp", "--dump-logits", out)
    assert r.exit_code == 0, r.stderr
    with safe_open(str(out), "np") as f:
        meta, logits = f.metadata(), f.get_tensor("logits")
    assert meta["command"] == "forward --mtp" and meta["positions"] == "[" + ",".join(map(str, range(1, 12))) + "]"
    assert float(np.max(np.abs(logits - g["mtp_logits"])) / np.max(np.abs(g["mtp_logits"]))) < 1e-5
    r = run_cli("forward", "--model", f"tests/fixtures/models/{name}", "--tokens", "[7]", "--mtp")
    assert r.exit_code == 5 and "2 or more tokens" in r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_verify_draft_mtp(name, run_cli):
    """verify --draft mtp: d[0] is the model's own token after the prompt, d[1..] the MTP layer's drafts, each
    recomputed here from scratch (the layer on the prompt's tokens and d[0] with the model's hidden rows, then
    on its own last row)."""
    import json

    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 300, 6)]
    r = run_cli("verify", "--model", f"tests/fixtures/models/{name}", "--tokens", str(prompt), "--draft", "mtp",
                "--k", 4, "--format", "json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    drafts = [row["draft"] for row in out["rows"]]
    assert out["draft_source"] == "mtp" and len(drafts) == 4
    target, mtp = engines(name)
    target.prefill(prompt, all_logits=True)
    assert drafts[0] == int(np.argmax(rows(target, target.logits_buffer_ptr(), len(prompt))[-1]))
    mtp.run(prompt[1:] + drafts[:1], target.copy_hidden_rows_to_host())
    for d in drafts[1:]:
        assert d == int(np.argmax(rows(mtp, mtp.logits_buffer_ptr(), 1)[0]))
        mtp.run([d], mtp.copy_hidden_rows_to_host()[-1:])


@pytest.mark.parametrize("name", NAMES)
def test_bf16_compute_tracks_transformers_bf16_mtp(name):
    """Like with like: --compute bf16's MTP layer against transformers' MtpModel in bf16, both fed transformers'
    bf16 hidden rows of the main model (the layer alone: a main model's bf16 rounding moves those rows by ~1e-2,
    enough to flip a near tie of the MTP layer's router). The golden's prompt, not a fresh one: in bf16 a
    router's near tie can send a row to another expert on one side only (the limitation the README states for
    mixtures of experts). Measured on 40 fresh prompts each: 2.9e-3 to 8.5e-3, except 3 of glm4_moe_mtp's, where
    the layer's router met such a tie (0.18 to 0.45)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    d = FIXTURES / "models" / name
    prompt = [int(t) for t in np.load(FIXTURES / "golden" / f"{name}.npz")["prompt"]]
    cfg = load_config(d)
    main = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager").eval()
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{cfg.num_hidden_layers}\..*"]  # as the script
    main.config.num_mtp_layers = 1
    layer = MtpModel.from_pretrained(main, device_map={"": "cpu"}).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = main(ids, output_hidden_states=True).hidden_states[-1]
        h = layer.forward_layer(0, hidden[:, :-1], torch.arange(1, len(prompt))[None], None, input_ids=ids[:, 1:])
        want = layer._project_to_logits(h)[0].float().numpy()
    mtp = load_numpy_mtp(cfg, Checkpoint.open(d), 64, fp32_logits=True, compute="bf16")
    n = mtp.run(prompt[1:], hidden[0, :-1].float().numpy(), all_logits=True)
    err = float(np.max(np.abs(rows(mtp, mtp.logits_buffer_ptr(), n) - want)) / np.max(np.abs(want)))
    print(f"{name}: bf16 MTP layer vs transformers bf16, max rel err {err:.2e}")
    assert err < 1e-2


def test_a_block_fp8_checkpoint_keeps_eh_proj_dense():
    """In a block-FP8 checkpoint (DeepSeek-V3's) the MTP block's projections are FP8 like the decoder's, eh_proj
    stays dense (engines load it as a plain Linear) and so do its norms."""
    import json

    from metrale_cli.config import parse_config

    raw = json.loads((FIXTURES / "models" / "deepseek_v3_mtp" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8], "activation_scheme": "dynamic"}
    layer = mtp_config(parse_config(raw)).definition.layers[0]
    formats = {p.key: p.format for p in layer.params}
    assert formats["mtp_eh_proj"] is None and formats["mtp_enorm"] is None and formats["mtp_hnorm"] is None
    assert formats["q_a"] is not None and formats["o"] is not None and formats["experts_gate_up"] is not None


def test_inspect_says_whether_the_mtp_layer_is_there_and_runs(run_cli):
    import json

    def mtp(name):
        r = run_cli("inspect", f"tests/fixtures/models/{name}", "--format", "json")
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout).get("mtp")

    assert mtp("deepseek_v3_mtp") == {"layers": 1, "present": True, "draft": True}
    assert mtp("deepseek_v3") == {"layers": 1, "present": False, "draft": False}  # declared, not shipped
    assert mtp("qwen3_moe") is None
    r = run_cli("inspect", "tests/fixtures/models/glm4_moe_mtp", "--format", "plain")
    assert "mtp: 1 multi-token-prediction layer, in the checkpoint; runs as a draft" in r.stdout


@pytest.mark.parametrize("mla", ["naive", "absorbed"])
def test_block_fp8_mtp_rows_match_transformers_on_the_exact_values(mla):
    """deepseek_v3_mtp_fp8_block (the MTP block's projections in FP8 blocks, eh_proj dense, as shipped): the MTP
    rows against transformers' MtpModel on the exact values the stored weights stand for."""
    name = "deepseek_v3_mtp_fp8_block"
    g = np.load(FIXTURES / "golden" / f"{name}_mtp.npz")
    target, mtp = engines(name, mla=mla)
    assert mtp.cfg.definition.layers[0].params[1].format is not None  # q_a_proj: FP8 blocks
    prompt = [int(t) for t in g["prompt"]]
    target.prefill(prompt, all_logits=True)
    herr = rel(target.copy_hidden_rows_to_host(), g["hidden_after_norm"])
    n = mtp.run(prompt[1:], target.copy_hidden_rows_to_host()[:-1], all_logits=True)
    err = float(np.max(np.abs(rows(mtp, mtp.logits_buffer_ptr(), n) - g["mtp_logits"])) / np.max(np.abs(g["mtp_logits"])))
    print(f"{name} ({mla}): MTP logits rel err {err:.2e}; main hidden rows {herr:.2e}")
    assert err < 1e-5 and herr < 1e-5


def test_activation_quant_emulate_reaches_the_mtp_layer(run_cli):
    """--activation-quant emulate quantizes the MTP block's FP8 projections' inputs as it does the model's: the
    layer's rows move on the same inputs (the main model's golden rows); forward --mtp runs with it."""
    name = "deepseek_v3_mtp_fp8_block"
    d, g = FIXTURES / "models" / name, np.load(FIXTURES / "golden" / f"{name}_mtp.npz")
    cfg, out = load_config(d), {}
    for mode in ("none", "emulate"):
        mtp = load_numpy_mtp(cfg, Checkpoint.open(d), 32, fp32_logits=True, activation_quant=mode)
        assert mtp.activation_quant == mode
        n = mtp.run([int(t) for t in g["prompt"][1:]], g["hidden_after_norm"][:-1], all_logits=True)
        out[mode] = rows(mtp, mtp.logits_buffer_ptr(), n)
    assert rel(out["emulate"], out["none"]) > 1e-3
    r = run_cli("forward", "--model", f"tests/fixtures/models/{name}", "--tokens", "[5, 17, 99]", "--mtp",
                "--activation-quant", "emulate")
    assert r.exit_code == 0, r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_forward_mtp_layer_dump_matches_transformers_modules(name, run_cli, tmp_path):
    """forward --mtp --dump-layers: the MTP layer's taps under the checkpoint's names, each against the output of
    the matching module of transformers' MtpModel (hooked) on the golden's prompt, positions 1..T-1."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    g = np.load(FIXTURES / "golden" / f"{name}.npz")
    prompt = [int(t) for t in g["prompt"]]
    out = tmp_path / "layers.safetensors"
    r = run_cli("forward", "--model", f"tests/fixtures/models/{name}", "--tokens", str(prompt), "--rows", "all",
                "--mtp", "--dump-layers", out)
    assert r.exit_code == 0, r.stderr
    with safe_open(str(out), "np") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert list(got["positions"]) == list(range(1, len(prompt)))

    d = FIXTURES / "models" / name
    L = load_config(d).num_hidden_layers
    main = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*"]  # as scripts/make_mtp_fixtures.py
    model = MtpModel.from_pretrained(main, device_map={"": "cpu"}).eval()
    layer, seen = model.layers[0], {}
    modules = {"enorm": layer.enorm, "hnorm": layer.hnorm, "eh_proj": layer.eh_proj,
               "self_attn": layer.mtp_block.self_attn, "mlp": layer.mtp_block.mlp, "": layer.mtp_block,
               "shared_head.norm": layer.post_norm}
    hooks = [m.register_forward_hook(lambda m, a, o, k=k: seen.__setitem__(k, o[0] if isinstance(o, tuple) else o))
             for k, m in modules.items()]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = main(ids, output_hidden_states=True).hidden_states[-1]
        model.forward_layer(0, hidden[:, :-1], torch.arange(1, len(prompt))[None], None, input_ids=ids[:, 1:])
    for h in hooks:
        h.remove()
    assert len(seen) == len(modules)
    for k, want in seen.items():
        key = f"model.layers.{L}" + (f".{k}" if k else "")
        want = want.reshape(-1, want.shape[-1]).numpy()
        err = float(np.max(np.abs(got[key] - want)) / np.max(np.abs(want)))
        assert err < 1e-5, f"{key}: {err:.2e}"
    assert f"model.layers.{L}.mlp.gate.top_k_index" in got  # the router's taps, as in the model's dumps


def test_forward_mtp_reports_where_the_first_draft_would_be_accepted(run_cli):
    """forward --mtp: each row beside the model's own argmax at that position (the target row a first draft from
    this row is verified against), and how many agree; plain forward has neither."""
    import json

    name = "glm4_moe_mtp"
    prompt = [int(t) for t in np.random.default_rng().integers(0, 300, 9)]
    r = run_cli("forward", "--model", f"tests/fixtures/models/{name}", "--tokens", str(prompt), "--rows", "all",
                "--mtp", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    target, mtp = engines(name)
    target.prefill(prompt, all_logits=True)
    model = np.argmax(rows(target, target.logits_buffer_ptr(), len(prompt)), axis=1)
    mtp.run(prompt[1:], target.copy_hidden_rows_to_host()[:-1], all_logits=True)
    layer = np.argmax(rows(mtp, mtp.logits_buffer_ptr(), len(prompt) - 1), axis=1)
    assert [row["model_argmax"] for row in doc["rows"]] == [int(t) for t in model[1:]]
    assert [row["argmax"] for row in doc["rows"]] == [int(t) for t in layer]
    assert doc["mtp_agreement"] == {"agree": int(np.sum(model[1:] == layer)), "rows": len(prompt) - 1}
    plain = json.loads(run_cli("forward", "--model", f"tests/fixtures/models/{name}", "--tokens", str(prompt),
                               "--format", "json").stdout)
    assert "mtp_agreement" not in plain and "model_argmax" not in plain["rows"][0]
