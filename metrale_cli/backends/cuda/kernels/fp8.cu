// FP8 W8A8's activation quantization on the GPU (`--activation-quant emulate`); FP8 weights themselves are read by
// qgemv.cu (its QE4m3 policy) and moe.cu.
#include "common.cu"
#include "e4m3.cu"

// An activation quantized as an FP8 W8A8 engine quantizes a weight's input (`--activation-quant emulate`; the
// definitions are models/quantized/activations.e4m3_groups and e4m3_static): per row of x f32 [M, K] and
// `group` consecutive columns (the last group partial; group = K: per token), s = amax / 448 (with ue8m0 the
// next power of two up; an all-zero group keeps s = 1), or the static scale *static_s when is_static;
// out = e4m3(clip(x / s, -448, 448)) * s, e4m3 rounded to nearest even (`cvt.rn.satfinite.e4m3x2.f32`, sm_89+)
// and widened back exactly.  grid (ceil(K / group), M), any multiple of 32 threads; out may be x.
extern "C" __global__ void fp8_act_quant_kernel(const float* x, int K, int group, int ue8m0,
                                                const float* __restrict__ static_s, int is_static, float* out) {
    __shared__ float scratch[32];
    pdl_wait();
    pdl_trigger();
    const int c0 = blockIdx.x * group, c1 = min(K, c0 + group);
    const float* row = x + (u64)blockIdx.y * K;
    float s;
    if (is_static) {
        s = *static_s;
    } else {
        float a = 0.0f;
        for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) a = fmaxf(a, fabsf(row[c]));
        s = block_max(a, scratch) / 448.0f;
        if (ue8m0) s = exp2f(ceilf(log2f(fmaxf(s, 1.17549435e-38f))));
        if (s == 0.0f) s = 1.0f;
    }
    float* dst = out + (u64)blockIdx.y * K;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float v = fminf(fmaxf(row[c] / s, -448.0f), 448.0f);
        unsigned short q;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(q) : "f"(0.0f), "f"(v));  // v in the low byte
        dst[c] = e4m3x2_to_f32(q).x * s;
    }
}
