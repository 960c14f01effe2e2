// The router kinds of models/spec.RouterSpec on the GPU: one device function per kind, each by one warp for one
// row of router logits, selected by the spec's kind (moe_choose_row).  Lane j < k ends with the j-th chosen expert
// (by decreasing choice score, equal scores by increasing index, as backends/numpy/routers.py) and its weight after
// the kind's renormalisation and routed_scaling_factor; the other lanes' are unspecified.
//   softmax_topk            (moe.cu's moe_topk_lane): p = softmax(logits), the k largest p;
//   sigmoid_biased_grouped  s = sigmoid(logits), the choice ranks s + correction within the topk_group groups (of
//                           n_group) whose two best choice scores sum highest; weights: the chosen s, divided by
//                           their sum + 1e-20 when norm_topk;
//   softmax_group_limited   p = softmax(logits), the k largest p within the topk_group groups whose largest p are
//                           highest (the other experts' p taken as 0, as transformers does).
//   topk_softmax            the k largest logits (the router bias already in them: the router GEMV adds it), then
//                           the softmax over those k alone (gpt-oss): w_j = exp(l_j - l_0) / sum_i exp(l_i - l_0),
//                           the sum over the choices in order; a NaN logit is chosen after every real one.
// Every kind's weights are then multiplied by routed_scaling_factor.  At most 32 groups (one lane each).
#include "common.cu"

#define MOE_ROUTER_SOFTMAX_TOPK 0
#define MOE_ROUTER_SIGMOID_GROUPED 1
#define MOE_ROUTER_SOFTMAX_GROUPED 2
#define MOE_ROUTER_TOPK_SOFTMAX 3
#define MOE_MAX_GROUPS 32

struct MoeRouter {
    int kind;                 // MOE_ROUTER_*
    int norm_topk;            // renormalise the k weights
    int n_group, topk_group;  // the grouped kinds' groups (n_group divides E)
    float scaling;            // routed_scaling_factor
    const float* correction;  // sigmoid_biased_grouped's choice correction [E] (fp32), or null
};

// An unsigned key increasing with v (any sign), never 0 (the key of an absent expert); -0 as +0.
__device__ __forceinline__ unsigned int moe_order_key(float v) {
    const unsigned int b = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The mask of the topk_group groups whose scores are highest (equal scores: the lowest group first; a NaN score
// after every real one); lane g < n_group holds group g's score.  Uniform over the warp.
__device__ __forceinline__ unsigned int moe_top_groups(float score, int n_group, int topk_group) {
    const int lane = threadIdx.x & 31;
    unsigned int key = lane >= n_group ? 0u : score != score ? 1u : moe_order_key(score);
    unsigned int mask = 0u;
#pragma unroll 1
    for (int j = 0; j < topk_group; ++j) {
        const unsigned int mk = __reduce_max_sync(0xffffffffu, key);
        const int g = (int)__reduce_min_sync(0xffffffffu, key == mk ? (unsigned int)lane : 32u);
        mask |= 1u << g;
        if (lane == g) key = 0u;
    }
    return mask;
}

// k rounds over the warp's keys (slot i of lane l: expert l + 32 i; 0: absent or picked): lane j gets the j-th
// largest key's expert and val of it (the owner lane's slot value, shuffled).
template <int NS>
__device__ __forceinline__ void moe_pick(unsigned int (&key)[NS], const float (&val)[NS], int k, int& e_out,
                                         float& w_out) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int j = 0; j < k; ++j) {
        unsigned int bk = 0u;
        int be = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < NS; ++i)
            if (key[i] > bk) {
                bk = key[i];
                be = lane + 32 * i;
            }
        const unsigned int mk = __reduce_max_sync(0xffffffffu, bk);
        be = (int)__reduce_min_sync(0xffffffffu, bk == mk ? (unsigned int)be : 0x7fffffffu);
        float mine = 0.0f;
#pragma unroll
        for (int i = 0; i < NS; ++i)
            if (lane + 32 * i == be) {
                key[i] = 0u;
                mine = val[i];
            }
        const float w = __shfl_sync(0xffffffffu, mine, be & 31);
        if (lane == j) {
            e_out = be;
            w_out = w;
        }
    }
}

// The k weights of lanes 0..k-1: divided by their sum (+ eps) when norm_topk (summed in slot order), times scaling.
__device__ __forceinline__ float moe_finish_weight(float w, int k, int norm_topk, float eps, float scaling) {
    if (norm_topk) {
        float t = 0.0f;
#pragma unroll 1
        for (int j = 0; j < k; ++j) t += __shfl_sync(0xffffffffu, w, j);
        w = w / (t + eps);
    }
    return w * scaling;
}

__device__ __forceinline__ float moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <int NS>
__device__ __forceinline__ void moe_sigmoid_grouped_lane(const float* __restrict__ logits, const MoeRouter& r, int E,
                                                         int k, int& e_out, float& w_out) {
    const int lane = threadIdx.x & 31;
    const float* corr = r.correction;
    float s[NS], c[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int e = lane + 32 * i;
        s[i] = e < E ? moe_sigmoid(logits[e]) : 0.0f;
        c[i] = e < E && corr != nullptr ? s[i] + corr[e] : s[i];  // the correction steers the choice only
    }
    unsigned int groups = 0xffffffffu;
    const int G = E / r.n_group;
    if (r.n_group > 1) {  // lane g scores group g: the sum of its two best choice scores
        float best = -METRALE_INF, second = -METRALE_INF;
        if (lane < r.n_group)
            for (int t = 0; t < G; ++t) {
                const int e = lane * G + t;
                const float s_e = moe_sigmoid(logits[e]);
                const float v = corr != nullptr ? s_e + corr[e] : s_e;
                if (v > best) {
                    second = best;
                    best = v;
                } else if (v > second) {
                    second = v;
                }
            }
        groups = moe_top_groups(best + second, r.n_group, r.topk_group);
    }
    unsigned int key[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int e = lane + 32 * i;
        key[i] = e >= E || !((groups >> (e / G)) & 1u) ? 0u : c[i] != c[i] ? 1u : moe_order_key(c[i]);
    }
    moe_pick<NS>(key, s, k, e_out, w_out);
    w_out = moe_finish_weight(w_out, k, r.norm_topk, 1e-20f, r.scaling);
}

template <int NS>
__device__ __forceinline__ void moe_softmax_grouped_lane(const float* __restrict__ logits, const MoeRouter& r, int E,
                                                         int k, int& e_out, float& w_out) {
    const int lane = threadIdx.x & 31;
    float p[NS];
    float mx = -METRALE_INF;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int e = lane + 32 * i;
        p[i] = e < E ? logits[e] : -METRALE_INF;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int e = lane + 32 * i;
        p[i] = e < E ? expf(p[i] - mx) : 0.0f;
        sum += p[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < NS; ++i) p[i] = p[i] / sum;
    const int G = E / r.n_group;
    float best = -METRALE_INF;  // lane g: group g's largest probability
    if (lane < r.n_group)
        for (int t = 0; t < G; ++t) best = fmaxf(best, expf(logits[lane * G + t] - mx) / sum);
    const unsigned int groups = moe_top_groups(best, r.n_group, r.topk_group);
    unsigned int key[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int e = lane + 32 * i;
        if (e < E && !((groups >> (e / G)) & 1u)) p[i] = 0.0f;  // an unchosen group's experts: probability 0
        key[i] = e >= E ? 0u : p[i] != p[i] ? 1u : __float_as_uint(p[i]) + 2u;
    }
    moe_pick<NS>(key, p, k, e_out, w_out);
    w_out = moe_finish_weight(w_out, k, r.norm_topk, 0.0f, r.scaling);
}

template <int NS>
__device__ __forceinline__ void moe_topk_softmax_lane(const float* __restrict__ logits, const MoeRouter& r, int E,
                                                      int k, int& e_out, float& w_out) {
    const int lane = threadIdx.x & 31;
    float l[NS];
    unsigned int key[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) {
        const int e = lane + 32 * i;
        l[i] = e < E ? logits[e] : 0.0f;
        key[i] = e >= E ? 0u : l[i] != l[i] ? 1u : moe_order_key(l[i]);
    }
    float chosen = 0.0f;  // lane j < k: the j-th largest logit
    moe_pick<NS>(key, l, k, e_out, chosen);
    const float top = __shfl_sync(0xffffffffu, chosen, 0);  // the largest: softmax's max
    const float z = lane < k ? expf(chosen - top) : 0.0f;
    float sum = 0.0f;
#pragma unroll 1
    for (int j = 0; j < k; ++j) sum += __shfl_sync(0xffffffffu, z, j);
    w_out = moe_finish_weight(z / sum, k, r.norm_topk, 0.0f, r.scaling);
}
