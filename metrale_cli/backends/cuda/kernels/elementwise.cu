// Element-wise kernels: embedding gather, dtype conversion, SwiGLU, KV-cache append.
#include "common.cu"

// out[m, :] = float(table[ids[m], :]) * scale (Gemma's sqrt(hidden) as an fp32 value; 1 otherwise).
// One block per row.  An id outside [0, V) writes NaN (a visible failure instead of an out-of-bounds read).
extern "C" __global__ void embedding_kernel(const int* __restrict__ ids,
                                            const unsigned short* __restrict__ table,
                                            float* __restrict__ out, int V, int H, float scale) {
    pdl_wait();
    pdl_trigger();
    const int m = blockIdx.x;
    const int id = ids[m];
    float* o = out + (u64)m * H;
    if (id < 0 || id >= V) {
        for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const unsigned short* t = table + (u64)id * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = bf16_to_f32_bits(t[i]) * scale;
}

// x = cap * tanh(x / cap) in place, every element of x[n] (Gemma 2's final-logit softcapping on
// every logits row the engine produces).
extern "C" __global__ void softcap_kernel(float* __restrict__ x, long long n, float cap) {
    pdl_wait();
    pdl_trigger();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = tanhf(x[i] / cap) * cap;
}

// Round-to-nearest-even float32 -> bf16 bits (torch CPU semantics, see common.cu).
extern "C" __global__ void f32_to_bf16_kernel(const float* __restrict__ x,
                                              unsigned short* __restrict__ out, long long n) {
    pdl_wait();
    pdl_trigger();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16_bits(x[i]);
}

extern "C" __global__ void bf16_to_f32_kernel(const unsigned short* __restrict__ x,
                                              float* __restrict__ out, long long n) {
    pdl_wait();
    pdl_trigger();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = bf16_to_f32_bits(x[i]);
}

// out[m, i] = act(gate_up[m, i]) * gate_up[m, I + i]: act = silu (g * sigmoid(g)) or gelu_tanh
// (gate_act, common.cu); act = ACT_SWIGLU_OAI: glu_oai(gate, up, limit, alpha) (gpt-oss's experts).
extern "C" __global__ void swiglu_kernel(const float* __restrict__ gate_up,
                                         float* __restrict__ out, int M, int I, int act, float limit,
                                         float alpha) {
    pdl_wait();
    pdl_trigger();
    const long long n = (long long)M * I;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long m = idx / I;
        const long long i = idx - m * I;
        const float g = gate_up[m * 2 * I + i];
        const float u = gate_up[m * 2 * I + I + i];
        out[idx] = glu_act(g, u, act, limit, alpha);
    }
}

// k, v: float32 [M, n_kv, hd]; caches: bf16 [n_kv, max_ctx, hd]; row m goes to
// position positions[m] (read on the device).  Positions outside [0, max_ctx)
// are skipped.
extern "C" __global__ void kv_append_kernel(const float* __restrict__ k,
                                            const float* __restrict__ v,
                                            unsigned short* __restrict__ k_cache,
                                            unsigned short* __restrict__ v_cache,
                                            const int* __restrict__ positions,
                                            int M, int n_kv, int hd, int max_ctx) {
    pdl_wait();
    pdl_trigger();
    const long long n = (long long)M * n_kv * hd;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const int d = (int)(idx % hd);
        const long long t = idx / hd;
        const int h = (int)(t % n_kv);
        const int m = (int)(t / n_kv);
        const int p = positions[m];
        if (p < 0 || p >= max_ctx) continue;
        const u64 dst = ((u64)h * max_ctx + p) * hd + d;
        k_cache[dst] = f32_to_bf16_bits(k[idx]);
        v_cache[dst] = f32_to_bf16_bits(v[idx]);
    }
}

// The attention output gate (qwen3_next, qwen3_5): the q projection is doubled, each head's rows [q_h; gate_h].
// gate_split: gated f32 [M, 2 nh hd + kv] -> plain f32 [M, nh hd + kv] (q heads, then the k and v columns as they
// are), the layout rope_kv_append reads.
extern "C" __global__ void gate_split_kernel(const float* __restrict__ gated, float* __restrict__ plain, int M,
                                             int nh, int hd, int kv) {
    pdl_wait();
    pdl_trigger();
    const int q = nh * hd, w = q + kv;
    const long long n = (long long)M * w;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(idx % w);
        const long long m = idx / w;
        const int src = i < q ? (i / hd) * 2 * hd + i % hd : q + i;
        plain[idx] = gated[m * (w + q) + src];
    }
}

// y f32 [M, nh hd] *= sigmoid(gate) in place, gate_h the second half of head h's rows of gated [M, 2 nh hd + kv].
extern "C" __global__ void output_gate_kernel(float* __restrict__ y, const float* __restrict__ gated, int M, int nh,
                                              int hd, int kv) {
    pdl_wait();
    pdl_trigger();
    const int q = nh * hd;
    const long long n = (long long)M * q;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(idx % q);
        const long long m = idx / q;
        const float g = gated[m * (2 * q + kv) + (i / hd) * 2 * hd + hd + i % hd];
        y[idx] = y[idx] * (1.0f / (1.0f + expf(-g)));
    }
}
