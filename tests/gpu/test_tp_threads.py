"""--tp N on ONE GPU (issue 17): N CUDA rank engines in threads of one process (tp_threads.py: the sharded
engines, RankServer and TensorParallelEngine as `--tp N` runs them; collectives through device copies and
a barrier instead of NCCL, eager passes) against the plain CUDA engine: the same greedy tokens
(teacher-forced; a differing argmax only at a bf16 near-tie) and logits within the bf16 tolerance, for a
short (rows path) and a long (cuBLAS) prefill, 8 decode steps, verify k=4 after a trim. This checks every
sharding rule of the CUDA ranks where no multi-GPU machine is lent: column/row-parallel projections, KV heads
replicated when N > num_key_value_heads, the vocabulary-parallel embedding and argmax, sandwich norms after
the all-reduce, and the experts split across ranks (each rank's route lists only the experts it holds, its
partial sum is all-reduced; a qwen2_moe shared expert split like a dense MLP). The NCCL communicator and
graph capture of a rank are test_tp_cuda.py's (one rank); the multi-GPU run itself is that file's too."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_cli.model import open_model

from test_tp_cuda import BASE, CONFIG, FAMILIES, TOL, _prompts, _same_argmax_unless_tied, _script, _write
from tp_threads import threaded_tp

pytestmark = pytest.mark.gpu

MOE = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e4,
                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen2_moe": dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=8, rope_theta=1e4,
                      num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=192,
                      norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral", num_attention_heads=8, num_key_value_heads=2, head_dim=32, rope_theta=1e4,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    seed = int(np.random.default_rng().integers(2**31))
    root = tmp_path_factory.mktemp("tp_threads")
    out = {"mistral": _write(root, "mistral", CONFIG, seed)}
    out.update({name: _write(root, name, {**BASE, **extra}, seed) for name, extra in {**FAMILIES, **MOE}.items()})
    print(f"tp (threads) checkpoints drawn with seed {seed}")
    return out


@pytest.mark.parametrize("name,n", [("mistral", 2), ("mistral", 4), ("mistral", 8), ("gemma2", 2), ("qwen2", 4),
                                    ("phi4_mini_like", 2), ("qwen3_moe", 2), ("qwen3_moe", 4), ("qwen2_moe", 2),
                                    ("qwen2_moe", 4), ("mixtral", 2), ("mixtral", 8)])
def test_tp_n_on_one_gpu_equals_the_plain_engine(cp, ckpts, rng, name, n):
    ckpt = ckpts[name]
    prompt, long_prompt = _prompts(rng)
    one = open_model(ckpt, device="cuda", max_context=96, fp32_logits=True)
    try:
        want = _script(one.engine, prompt, long_prompt)
    finally:
        one.close()
    feed = [want[3 + 2 * i - 2] if i else want[1][-1] for i in range(8)]  # the plain engine's greedy tokens
    with threaded_tp(ckpt, n, max_context=96) as many:
        got = _script(many, prompt, long_prompt, feed=feed)
    worst = 0.0
    for i, (w, g) in enumerate(zip(want, got)):
        w, g = np.asarray(w), np.asarray(g)
        if w.dtype == np.float32 and w.ndim == 2 and w.shape[1] == 1003:  # logits rows
            err = float(np.linalg.norm(g - w) / np.linalg.norm(w))
            worst = max(worst, err)
            assert err <= TOL, f"item {i}: rel err {err:.2e}"
            _same_argmax_unless_tied(w, g, f"item {i}")
        elif w.dtype == np.float32:  # hidden rows
            assert float(np.linalg.norm(g - w) / np.linalg.norm(w)) <= TOL, f"item {i}"
    print(f"{name} tp {n} (threads, one GPU) vs plain: logits rel err <= {worst:.2e}")
