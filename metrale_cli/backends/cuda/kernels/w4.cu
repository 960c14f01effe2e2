// 4-bit weights with per-group scales: NVFP4 (ModelOpt, compressed-tensors nvfp4-pack-quantized: e2m1 codes, one
// scale per 16 values) and compressed-tensors' symmetric int4 (pack-quantized W4A16: q + 8 stored, a scale per
// group, row or tensor).  The rows path's GEMV reads the packed codes and dequantizes in registers; the prefill
// path dequantizes to bf16 for cuBLAS.
//
// Weight: 32-bit words [N, KWp] (uint32), eight 4-bit codes a word, value k of a row in bits 4 (k % 8) .. 4 (k % 8)
// + 3 of the row's word k / 8 (both formats store them so: NVFP4's two codes a byte, the low nibble first, read as
// little-endian words; pack-quantized's int32 words, value i at bit 4 i).  K (the logical input width) is a
// multiple of 8, KW = K / 8 words hold a row, and each row is padded with zero words to KWp = 4 ceil(KW / 4), so
// that every row starts on 16 bytes; the padding is never read as a value.
// Scales: float32 [N, ceil(K / group)], the scale of weight (n, k) at [n, k / group], group a multiple of 8 (a
// word never straddles two groups).  The engine forms each scale on the host at upload exactly as the NumPy
// engine forms it (NVFP4: fp32(e4m3 scale) * weight_scale_2 or / weight_global_scale; int4: the stored scale as
// fp32, a per-row or per-tensor scale repeated to one per row), so a weight's value here is one fp32 product,
// code value * scale, which is the NumPy engine's dequantized value bit for bit:
//   FMT 0 (e2m1, e2m1.cu): codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and bit 3 the sign (code 8 is -0);
//   FMT 1 (int4): the code minus 8, in -8..7.
//
// gemv_w4_kernel<FMT, M, R>:  out[M, N] (=|+=) x[M, K] @ (w * scale)[N, K]^T (+ bias), fp32 accumulation; partial
// sums reduced with warp shuffles.  Requirements (checked by W4Kernels.gemv): K % 8 == 0, group % 8 == 0,
// 1 <= M <= 16, w and x 16-byte aligned.
#include "common.cu"
#include "e2m1.cu"

#define W4_WARPS 4
#define W4_U 2

// The 8 weights of a word (k order) times their group's scale, as fp32: each the fp32 product of the code's exact
// value (FMT 0: e2m1, e2m1.cu; FMT 1: q - 8) and the scale.
template <int FMT>
__device__ __forceinline__ void w4x8_scaled(unsigned int word, float s, float (&w)[8]) {
    if (FMT == 0) {
        e2m1x8<0>(word, w);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] *= s;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = (float)((int)((word >> (4 * i)) & 0xFu) - 8) * s;
    }
}

// A warp owns R consecutive output rows; lane l walks the 16-byte chunks (4 words, 32 values) l, l + 32, ... of all
// R rows (W4_U chunks of each in flight).  Each word's weights are widened and scaled once and used for every row
// of x, and each 8 values of x are loaded once for the R weight rows.  The last chunk of a row may hold padding
// words (index >= KW): they are skipped, and x is never read past K.
template <int FMT, int M, int R>
__global__ void __launch_bounds__(W4_WARPS * 32)
gemv_w4_kernel(const float* __restrict__ x, const uint4* __restrict__ w, const float* __restrict__ scale,
               const unsigned short* __restrict__ bias, float* __restrict__ out, int N, int K, int group, int G,
               int accumulate, int has_bias) {
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * W4_WARPS + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;  // whole warp; no block barrier below
    const int KW = K >> 3;        // words of values per row
    const int C = (KW + 3) >> 2;  // 16-byte chunks per row (the padded row)
    const int words_per_group = group >> 3;
    const uint4* rows[R];
    const float* scales[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int n = min(n0 + r, N - 1);  // rows past N - 1 are read, never stored
        rows[r] = w + (u64)n * C;
        scales[r] = scale + (u64)n * G;
    }
    // PDL (common.cu): pull this warp's first weight chunks into L2 while the kernel that wrote x finishes; x and
    // out are touched only after pdl_wait.
#pragma unroll
    for (int u = 0; u < W4_U; ++u)
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
    for (int c0 = lane; c0 < C; c0 += 32 * W4_U) {
        uint4 wv[W4_U][R];
#pragma unroll
        for (int u = 0; u < W4_U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (c0 + 32 * u < C) wv[u][r] = ld_stream_u4(rows[r] + c0 + 32 * u);
#pragma unroll
        for (int u = 0; u < W4_U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= C) break;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int wi = 4 * c + j;  // the word's index in its row
                if (wi >= KW) break;       // padding
                float wf[R][8];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const unsigned int word = j == 0 ? wv[u][r].x : j == 1 ? wv[u][r].y : j == 2 ? wv[u][r].z
                                                                                               : wv[u][r].w;
                    w4x8_scaled<FMT>(word, __ldg(scales[r] + wi / words_per_group), wf[r]);
                }
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const float4* xp = reinterpret_cast<const float4*>(x + (u64)m * K + 8 * wi);
                    const float4 a = __ldg(xp), b = __ldg(xp + 1);
                    const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wf[r][i], xv[i], acc[r][m]);
                }
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

// out[n, k] = bf16(value(w[n, k]) * scale[n, k / group]), round to nearest even: the prefill path's weight for
// cuBLAS, out bf16 [N, K] (one thread per word: 8 weights, one scale, one 16-byte store; padding words are not
// visited).
template <int FMT>
__global__ void dequant_w4_bf16_kernel(const unsigned int* __restrict__ w, const float* __restrict__ scale,
                                       uint4* __restrict__ out, int N, int K, int group, int G) {
    pdl_wait();  // its output may be read by a kernel launched before this one finished (common.cu)
    pdl_trigger();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const int KW = K >> 3, KWp = ((KW + 3) >> 2) << 2;
    if (i >= (u64)N * KW) return;
    const int n = (int)(i / KW), wi = (int)(i % KW);
    float v[8];
    w4x8_scaled<FMT>(w[(u64)n * KWp + wi], scale[(u64)n * G + wi / (group >> 3)], v);
    out[i] = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                        pack_bf16x2(v[6], v[7]));
}
