// FP8 (e4m3) weights with block scales (models/quantized/fp8.py): the rows path's GEMV, which reads the
// stored bytes and dequantizes in registers, and the prefill path's dequantization to bf16 for cuBLAS.
//
// Weight: e4m3 bytes [N, K] (Hugging Face [out, in] layout).  Scales: float32 [ceil(N / srow), KB], the scale
// of weight (n, k) at [n / srow, k / bk], bk a multiple of 16 (a 16-byte chunk never straddles two scale
// blocks).  srow is the checkpoint's block height, or 1 where the engine expanded a fused weight's scales
// to one row each (its parts' row counts were not multiples of the block height).
//
// e4m3 -> fp32 is exact (e4m3.cu's conversions).
//
// gemv_fp8_kernel<M, R>:  out[M, N] (=|+=) x[M, K] @ (w * scale)[N, K]^T (+ bias), fp32 accumulation; partial
// sums reduced with warp shuffles.  Requirements (checked by Fp8Kernels.gemv): K % 16 == 0, 1 <= M <= 16, w and
// x 16-byte aligned.
#include "common.cu"
#include "e4m3.cu"

#define FP8_WARPS 4
#define FP8_U 2

// A warp owns R consecutive output rows; lane l walks the 16-byte chunks l, l + 32, ... of all R rows (FP8_U
// chunks of each in flight).  Each chunk's weights are widened and scaled once and used for every row of x,
// and each x chunk is loaded once for the R weight rows.
template <int M, int R>
__global__ void __launch_bounds__(FP8_WARPS * 32)
gemv_fp8_kernel(const float* __restrict__ x, const uint4* __restrict__ w, const float* __restrict__ scale,
                const unsigned short* __restrict__ bias, float* __restrict__ out, int N, int K, int srow, int bk,
                int KB, int accumulate, int has_bias) {
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * FP8_WARPS + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;  // whole warp; no block barrier below
    const int C = K >> 4;  // 16-byte chunks per row
    const int chunks_per_block = bk >> 4;
    const uint4* rows[R];
    const float* scales[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int n = min(n0 + r, N - 1);  // rows past N - 1 are read, never stored
        rows[r] = w + (u64)n * C;
        scales[r] = scale + (u64)(n / srow) * KB;
    }
    // PDL (common.cu): pull this warp's first weight chunks into L2 while the kernel that wrote x finishes; x and
    // out are touched only after pdl_wait.
#pragma unroll
    for (int u = 0; u < FP8_U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (lane + 32 * u < C) prefetch_l2(rows[r] + lane + 32 * u);
    pdl_wait();
    pdl_trigger();
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    for (int c0 = lane; c0 < C; c0 += 32 * FP8_U) {
        uint4 wv[FP8_U][R];
#pragma unroll
        for (int u = 0; u < FP8_U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (c0 + 32 * u < C) wv[u][r] = ld_stream_u4(rows[r] + c0 + 32 * u);
#pragma unroll
        for (int u = 0; u < FP8_U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= C) break;
            float wf[R][16];
#pragma unroll
            for (int r = 0; r < R; ++r) e4m3x16_scaled(wv[u][r], __ldg(scales[r] + c / chunks_per_block), wf[r]);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float4* xp = reinterpret_cast<const float4*>(x + (u64)m * K) + 4 * c;
                float xv[16];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float4 v = __ldg(xp + j);
                    xv[4 * j] = v.x;
                    xv[4 * j + 1] = v.y;
                    xv[4 * j + 2] = v.z;
                    xv[4 * j + 3] = v.w;
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int j = 0; j < 16; ++j) acc[r][m] = fmaf(wf[r][j], xv[j], acc[r][m]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int n = n0 + r;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (lane == ((r * M + m) & 31) && n < N) {
                float v = acc[r][m];
                if (has_bias) v += bf16_to_f32_bits(bias[n]);
                float* o = out + (u64)m * N + n;
                if (accumulate) v += *o;
                *o = v;
            }
        }
    }
}

// out[n, k] = bf16(e4m3(w[n, k]) * scale[n / srow, k / bk]), round to nearest even: the prefill path's weight
// for cuBLAS (one thread per 16-byte chunk: 16 weights, one scale).
extern "C" __global__ void dequant_fp8_bf16_kernel(const uint4* __restrict__ w, const float* __restrict__ scale,
                                                   uint4* __restrict__ out, int N, int K, int srow, int bk, int KB) {
    pdl_wait();  // its output may be read by a kernel launched before this one finished (common.cu)
    pdl_trigger();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const int C = K >> 4;
    if (i >= (u64)N * C) return;
    const int n = (int)(i / C), c = (int)(i % C);
    const float s = scale[(u64)(n / srow) * KB + (c * 16) / bk];
    const uint4 q = w[i];
    const unsigned int words[4] = {q.x, q.y, q.z, q.w};
    unsigned int packed[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 a = e4m3x2_to_f32((unsigned short)(words[j] & 0xffffu));
        const float2 b = e4m3x2_to_f32((unsigned short)(words[j] >> 16));
        packed[2 * j] = pack_bf16x2(a.x * s, a.y * s);
        packed[2 * j + 1] = pack_bf16x2(b.x * s, b.y * s);
    }
    out[2 * i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    out[2 * i + 1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

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
