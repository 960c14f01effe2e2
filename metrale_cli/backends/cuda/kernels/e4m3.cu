// e4m3 -> fp32 conversions shared by fp8.cu (the FP8 projections) and moe.cu (FP8 experts).
//
// e4m3 -> fp32 is exact: `cvt.rn.f16x2.e4m3x2` (sm_89+) widens two e4m3 values to two halves (every e4m3
// value, subnormals included, is a half), and a half converts to fp32 exactly.  The modules that use these put
// this file after common.cu and remove the include lines (kernels/fp8.py, kernels/moe.py); the include guard lets
// a .cu file include it on its own (nvcc -ptx).
#ifndef METRALE_E4M3_CU
#define METRALE_E4M3_CU

// Two e4m3 values (low byte first) as two floats, exactly.
__device__ __forceinline__ float2 e4m3x2_to_f32(unsigned short v) {
    unsigned int h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(h2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(h2 >> 16)));
    return make_float2(lo, hi);
}

// The 16 e4m3 weights of a 16-byte chunk (k order) times their block's scale, as fp32: each the fp32 product
// of the exact value and the scale, the value the NumPy engine's dequantization gives.
__device__ __forceinline__ void e4m3x16_scaled(const uint4& q, float s, float (&w)[16]) {
    const unsigned int words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 a = e4m3x2_to_f32((unsigned short)(words[j] & 0xffffu));
        const float2 b = e4m3x2_to_f32((unsigned short)(words[j] >> 16));
        w[4 * j] = a.x * s;
        w[4 * j + 1] = a.y * s;
        w[4 * j + 2] = b.x * s;
        w[4 * j + 3] = b.y * s;
    }
}

#endif  // METRALE_E4M3_CU
