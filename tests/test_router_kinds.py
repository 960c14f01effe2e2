"""The router kinds, gated units and attention sinks of the NumPy engine against transformers' own modules
(DeepseekV3TopkRouter, GptOssTopKRouter, GptOssExperts' clamped SwiGLU, gpt-oss's eager attention with
sinks), on fresh random inputs. These are the pieces a family of the DeepSeek-V3 / GLM-4.5 / gpt-oss kind
combines; the families themselves come with their own end-to-end tests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from metrale_cli.backends.numpy import moe, ops
from metrale_cli.backends.numpy.attention import AttentionOps, KVCache
from metrale_cli.models.spec import (AttentionSpec, LayerSpec, MlpSpec, ModelDefinition, MoeSpec, Norm, Param, Rope,
                                     RouterSpec)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.reference


def _same_choice(ours_idx, ours_w, ref_idx, ref_w):
    """Equal as sets per row (transformers' sorted=False gives no order), weights matched by expert."""
    for r in range(ours_idx.shape[0]):
        a = dict(zip(ours_idx[r].tolist(), ours_w[r].tolist()))
        b = dict(zip(ref_idx[r].tolist(), ref_w[r].tolist()))
        assert a.keys() == b.keys(), (r, a, b)
        np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(a)], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n_group,topk_group,norm,scale", [(1, 1, True, 1.0), (4, 2, True, 2.5), (8, 3, False, 1.0)])
def test_sigmoid_biased_grouped_equals_deepseek_v3_router(n_group, topk_group, norm, scale):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    rng = np.random.default_rng(n_group * 10 + topk_group)
    e, h, k, t = 32, 24, 6, 40
    cfg = DeepseekV3Config(hidden_size=h, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    ref = DeepseekV3TopkRouter(cfg)
    w = rng.standard_normal((e, h), dtype=np.float32) * 0.3
    corr = rng.standard_normal(e).astype(np.float32) * 0.2  # large enough to change choices
    x = rng.standard_normal((t, h), dtype=np.float32)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        ref.e_score_correction_bias.copy_(torch.from_numpy(corr))
        logits, ref_w, ref_idx = ref(torch.from_numpy(x))
    spec = MoeSpec(e, k, 8, norm, router=RouterSpec("sigmoid_biased_grouped", n_group=n_group, topk_group=topk_group,
                                                    routed_scaling_factor=scale))
    r = moe.route(x, w, spec, correction=corr)
    np.testing.assert_allclose(r.logits, logits.numpy(), rtol=1e-5, atol=1e-6)
    _same_choice(r.top_k_index, r.top_k_weights, ref_idx.numpy(), ref_w.numpy())
    # the correction moves the choice, never the weights: without it some rows choose other experts
    plain = moe.route(x, w, spec)
    assert (np.sort(plain.top_k_index, 1) != np.sort(r.top_k_index, 1)).any()


def test_topk_softmax_equals_gpt_oss_router():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    rng = np.random.default_rng(7)
    e, h, k, t = 16, 24, 4, 30
    ref = GptOssTopKRouter(GptOssConfig(hidden_size=h, num_local_experts=e, num_experts_per_tok=k))
    w = rng.standard_normal((e, h), dtype=np.float32) * 0.3
    b = rng.standard_normal(e).astype(np.float32)
    x = rng.standard_normal((t, h), dtype=np.float32)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        ref.bias.copy_(torch.from_numpy(b))
        logits, ref_w, ref_idx = ref(torch.from_numpy(x))
    spec = MoeSpec(e, k, 8, False, router=RouterSpec("topk_softmax", bias=True))
    r = moe.route(x, w, spec, bias=b)
    np.testing.assert_allclose(r.logits, logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(r.top_k_index, ref_idx.numpy())  # torch sorts here: the same order
    np.testing.assert_allclose(r.top_k_weights, ref_w.numpy(), rtol=2e-6, atol=1e-7)


def test_clamped_swiglu_with_biases_equals_gpt_oss_experts():
    """One expert of GptOssExperts (interleaved gate/up columns in its layout) against moe.experts with
    metrale's [gate; up] rows: the clamp, the alpha, the (up + 1) and both biases."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    rng = np.random.default_rng(3)
    e, h, i, t = 2, 16, 12, 9
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, swiglu_limit=1.5)
    ref = GptOssExperts(cfg)
    gu = rng.standard_normal((e, h, 2 * i), dtype=np.float32)  # transformers' layout: x @ gate_up_proj
    gu_b = rng.standard_normal((e, 2 * i), dtype=np.float32)
    dn = rng.standard_normal((e, i, h), dtype=np.float32) * 0.3
    dn_b = rng.standard_normal((e, h), dtype=np.float32)
    x = rng.standard_normal((t, h), dtype=np.float32)
    idx = np.stack([rng.permutation(e) for _ in range(t)])  # both experts, in some order, per row
    wts = rng.random((t, e), dtype=np.float32)
    with torch.no_grad():
        for name, v in (("gate_up_proj", gu), ("gate_up_proj_bias", gu_b), ("down_proj", dn), ("down_proj_bias", dn_b)):
            getattr(ref, name).copy_(torch.from_numpy(v))
        want = ref(torch.from_numpy(x), torch.from_numpy(idx), torch.from_numpy(wts)).numpy()
    # metrale's layout: [E, 2I, H] with the gate rows first (the family de-interleaves at load)
    w_gu = np.concatenate([gu[:, :, 0::2], gu[:, :, 1::2]], axis=2).transpose(0, 2, 1)
    b_gu = np.concatenate([gu_b[:, 0::2], gu_b[:, 1::2]], axis=1)
    route = moe.Route(None, idx, wts)
    got = moe.experts(x, route, w_gu, dn.transpose(0, 2, 1), ops.glu("swiglu_oai", 1.5, cfg.swiglu_alpha), 0,
                      (b_gu, dn_b))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.abs(x @ w_gu[0].T).max() > 1.5  # the clamp is exercised


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_equal_gpt_oss_eager_attention(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    rng = np.random.default_rng(11)
    nh, nkv, d, t = 4, 2, 8, 6
    a = AttentionSpec(nh, nkv, d, Rope(1e4, d), scale=d ** -0.5, window=window, sinks=True)
    q = rng.standard_normal((t, nh, d), dtype=np.float32)
    k = rng.standard_normal((nkv, t, d), dtype=np.float32)
    v = rng.standard_normal((nkv, t, d), dtype=np.float32)
    sinks = rng.standard_normal(nh).astype(np.float32) * 2
    definition = ModelDefinition("toy", (LayerSpec(a, MlpSpec(8), Norm(1e-6), ()),), Param.of("embed", ("e", (1, 1))),
                                 Param.of("final_norm", ("n", (1,))), None, Norm(1e-6))
    cache = KVCache(definition, max_context=t, rows=t)
    cache.write(0, 0, k, v)
    got = AttentionOps(SimpleNamespace(t=t, start=0, r=ops.keep), cache).attention(q, 0, a, sinks=sinks)
    mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
    if window is not None:
        mask[np.tril(np.ones((t, t), bool), -window)] = -np.inf
    module = SimpleNamespace(num_key_value_groups=nh // nkv, sinks=torch.from_numpy(sinks), training=False)
    want, _ = eager_attention_forward(module, torch.from_numpy(q.transpose(1, 0, 2))[None],
                                      torch.from_numpy(k)[None], torch.from_numpy(v)[None],
                                      torch.from_numpy(mask)[None, None], d ** -0.5)
    np.testing.assert_allclose(got, want.numpy().reshape(t, nh * d), rtol=1e-5, atol=1e-6)
    plain = AttentionOps(SimpleNamespace(t=t, start=0, r=ops.keep), cache).attention(q, 0, a)
    assert np.abs(plain - got).max() > 1e-3  # the sinks matter
