"""Dumps laid out as vLLM and SGLang write them, with values from transformers, for `metrale compare` to
read: forward hooks on a Hugging Face Llama give every module's output, which is then shaped the way those
engines' modules return it (fused qkv_proj and gate_up_proj, add-and-norm returning (normed, residual), a
decoder layer returning (mlp output, residual), q/k after rope, TP shards per rank) and written with real
torch.save into each engine's folder layout (metrale_cli/readers/vllm.py and sglang.py describe them).

    python scripts/engine_dumps.py vllm OUT --tokens "0 341 343 455" [--model DIR] [--tp 2]
        [--prefill N] [--perturb model.layers.1.mlp@2]

--prefill N: the first N tokens are step 0, then one decode step per token (default: all but the last);
--perturb MODULE@POSITION adds 5% of the module output's largest magnitude at that position (every rank's
copy), standing in for an engine that diverges there. Runs from a source checkout (needs torch and
transformers: pip install 'metrale[reference]'); tests/test_compare_engines.py uses the same writers.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def hf_modules(model_dir: str | Path, tokens: list[int]) -> dict:
    """Every module output a Llama forward gives, [T, width] fp32 torch tensors, plus logits."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = model.config
    out: dict = {}
    hooks = []

    def save(name, pre=False):
        def hook(_m, args, result=None):
            value = args[0] if pre else (result[0] if isinstance(result, tuple) else result)
            out[name] = value[0].detach().clone()
        return hook

    m = model.model
    hooks.append(m.embed_tokens.register_forward_hook(save("embed")))
    for i, layer in enumerate(m.layers):
        a, f = layer.self_attn, layer.mlp
        for mod, name in ((layer.input_layernorm, "n1"), (a.q_proj, "q"), (a.k_proj, "k"), (a.v_proj, "v"),
                          (a.o_proj, "attn_out"), (layer.post_attention_layernorm, "n2"), (f.gate_proj, "gate"),
                          (f.up_proj, "up"), (f.down_proj, "mlp_out"), (layer, "layer")):
            hooks.append(mod.register_forward_hook(save(f"{i}.{name}")))
        hooks.append(a.o_proj.register_forward_pre_hook(save(f"{i}.attn", pre=True)))
        hooks.append(f.down_proj.register_forward_pre_hook(save(f"{i}.act", pre=True)))
    hooks.append(m.norm.register_forward_hook(save("norm")))
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out["logits"] = model(ids).logits[0]
        pos = torch.arange(len(tokens))[None]
        cos, sin = m.rotary_emb(out["embed"][None], pos)
    for h in hooks:
        h.remove()
    hd, T = cfg.head_dim, len(tokens)
    for i in range(cfg.num_hidden_layers):
        q = out[f"{i}.q"].view(T, -1, hd).transpose(0, 1)[None]
        k = out[f"{i}.k"].view(T, -1, hd).transpose(0, 1)[None]
        qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
        out[f"{i}.q_rope"] = qr[0].transpose(0, 1).reshape(T, -1)
        out[f"{i}.k_rope"] = kr[0].transpose(0, 1).reshape(T, -1)
    out["config"] = cfg
    return out


def _shards(x: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return list(x.chunk(tp, dim=-1))


def engine_outputs(h: dict, tp: int, rows: slice) -> list[dict]:
    """Per TP rank: module path -> output (a tensor or a tuple), for the given rows, as vLLM/SGLang return."""
    cfg = h["config"]
    L = cfg.num_hidden_layers
    ranks = []
    for r in range(tp):
        d: dict = {"model.embed_tokens": h["embed"][rows]}
        residual = h["embed"]
        for i in range(L):
            p = f"model.layers.{i}"
            n1 = h[f"{i}.n1"][rows]
            d[f"{p}.input_layernorm"] = n1 if i == 0 else (n1, residual[rows])
            q, k, v = (_shards(h[f"{i}.{x}"][rows], tp)[r] for x in "qkv")
            d[f"{p}.self_attn.qkv_proj"] = (torch.cat([q, k, v], -1), None)
            d[f"{p}.self_attn.rotary_emb"] = (_shards(h[f"{i}.q_rope"][rows], tp)[r],
                                              _shards(h[f"{i}.k_rope"][rows], tp)[r])
            d[f"{p}.self_attn.attn"] = _shards(h[f"{i}.attn"][rows], tp)[r]
            d[f"{p}.self_attn.o_proj"] = (h[f"{i}.attn_out"][rows], None)
            d[f"{p}.self_attn"] = h[f"{i}.attn_out"][rows]
            mid = residual + h[f"{i}.attn_out"]
            d[f"{p}.post_attention_layernorm"] = (h[f"{i}.n2"][rows], mid[rows])
            g, u = (_shards(h[f"{i}.{x}"][rows], tp)[r] for x in ("gate", "up"))
            d[f"{p}.mlp.gate_up_proj"] = (torch.cat([g, u], -1), None)
            d[f"{p}.mlp.act_fn"] = _shards(h[f"{i}.act"][rows], tp)[r]
            d[f"{p}.mlp.down_proj"] = (h[f"{i}.mlp_out"][rows], None)
            d[f"{p}.mlp"] = h[f"{i}.mlp_out"][rows]
            d[p] = (h[f"{i}.mlp_out"][rows], mid[rows])
            residual = h[f"{i}.layer"]
        d["model.norm"] = (h["norm"][rows], residual[rows])
        ranks.append(d)
    return ranks


def write_vllm(root: Path, h: dict, tokens: list[int], tp: int, steps: list[slice]) -> Path:
    """vLLM intermediate logging: root/step_{s}/{module}/outputs[_i]_cuda_{r}.pt, inputs for embed and rope."""
    for s, rows in enumerate(steps):
        step = root / f"step_{s}"
        positions = torch.arange(len(tokens))[rows]
        for r, d in enumerate(engine_outputs(h, tp, rows)):
            for name, value in d.items():
                if name.endswith("self_attn.rotary_emb"):
                    layer = int(name.split(".")[2])
                    name = "model.layers.0.self_attn.rotary_emb" + (f"_{layer}" if layer else "")
                    _save(step / name / f"inputs_0_cuda_{r}.pt", positions)
                _save_outputs(step / name, value, f"cuda_{r}")
            _save(step / "model.embed_tokens" / f"inputs_0_cuda_{r}.pt", torch.tensor(tokens)[rows])
        _save(step / "logits_processor" / "outputs_cuda_0.pt", h["logits"][rows][-1:])
    return root


def write_sglang(root: Path, h: dict, tokens: list[int], tp: int, steps: list[slice], pp: int = 1) -> list[Path]:
    """SGLang --debug-tensor-dump-output-folder: root/TP{t}_PP{p}_Rank{r}_pid{n}/Pass{k:05d}.pt dicts (rank r =
    p * tp + t); the model's and logits_processor's outputs of pass k in pass k + 1's file. With pp stages,
    stage p holds its contiguous share of the layers (the embedding on the first, the norm, model and logits
    outputs on the last), each with the pass's input ids and positions."""
    L = h["config"].num_hidden_layers
    bounds = [round(L * s / pp) for s in range(pp + 1)]

    def on_stage(name: str, stage: int) -> bool:
        if name.startswith("model.layers."):
            return bounds[stage] <= int(name.split(".")[2]) < bounds[stage + 1]
        return stage == (0 if name == "model.embed_tokens" else pp - 1)

    dirs = [root / f"TP{t}_PP{st}_Rank{st * tp + t}_pid{4000 + st * tp + t}" for st in range(pp) for t in range(tp)]
    late: list[dict] = [{} for _ in dirs]
    for k, rows in enumerate(steps + [None]):
        for i, d_path in enumerate(dirs):
            st, r = divmod(i, tp)
            d = dict(late[i])
            if rows is not None:
                for name, value in engine_outputs(h, tp, rows)[r].items():
                    if name.endswith(("self_attn", "mlp")) or name.split(".")[-1].isdigit() or not on_stage(name, st):
                        continue  # leaf modules of this stage only
                    d[name] = _listed(value)
                d["model.forward_batch_info.input_ids"] = torch.tensor(tokens)[rows]
                d["model.forward_batch_info.positions"] = torch.arange(len(tokens))[rows]
                d["model.forward_batch_info.seq_lens"] = torch.tensor([rows.stop])
                if st == pp - 1:
                    late[i] = {"model": h["norm"][rows], "logits_processor": h["logits"][rows][-1:]}
            d_path.mkdir(parents=True, exist_ok=True)
            torch.save(d, d_path / f"Pass{k:05d}.pt")
    return dirs


def _listed(value):
    if isinstance(value, tuple):
        ts = [v for v in value if isinstance(v, torch.Tensor)]
        return ts[0] if len(ts) == 1 else ts
    return value


def _save_outputs(d: Path, value, device: str) -> None:
    if isinstance(value, tuple):
        for i, v in enumerate(value):
            if v is not None:
                _save(d / f"outputs_{i}_{device}.pt", v)
    else:
        _save(d / f"outputs_{device}.pt", value)


def _save(path: Path, t: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(t.detach().clone(), path)


def fresh_tokens(n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng().integers(1, vocab, n)]


def perturb(h: dict, module: str, position: int) -> None:
    """Add 5% of the output's largest magnitude at one position, in the transformers outputs `h`."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(mlp|self_attn)", module)
    if m is None:
        raise SystemExit(f"--perturb: {module!r} is not model.layers.N.mlp or model.layers.N.self_attn")
    key = f"{m.group(1)}.{'mlp_out' if m.group(2) == 'mlp' else 'attn_out'}"
    x = h[key].clone()
    x[position] += 0.05 * x.abs().max()
    h[key] = x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["vllm", "sglang"])
    ap.add_argument("out")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--model", default=str(ROOT / "metrale_cli" / "assets" / "models" / "default"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (sglang only)")
    ap.add_argument("--prefill", type=int)
    ap.add_argument("--perturb")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split()]
    h = hf_modules(args.model, tokens)
    if args.perturb:
        module, _, pos = args.perturb.partition("@")
        perturb(h, module, int(pos))
    n = len(tokens) - 1 if args.prefill is None else args.prefill
    steps = [slice(0, n)] + [slice(k, k + 1) for k in range(n, len(tokens))]
    if args.engine == "vllm":
        if args.pp != 1:
            ap.error("--pp: written for sglang only")
        write_vllm(Path(args.out), h, tokens, args.tp, steps)
    else:
        write_sglang(Path(args.out), h, tokens, args.tp, steps, args.pp)
    what = f", {args.perturb} perturbed" if args.perturb else ""
    stages = f" x {args.pp} pipeline stages" if args.pp > 1 else ""
    print(f"{args.out}: {args.engine} dump of {len(tokens)} tokens in {len(steps)} steps over {args.tp} TP "
          f"ranks{stages}{what} (transformers, {Path(args.model).name})")


if __name__ == "__main__":
    main()
