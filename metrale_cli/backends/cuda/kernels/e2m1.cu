// e2m1 (FP4) codes -> fp32, shared by qgemv.cu (NVFP4 projections) and moe.cu (MXFP4 experts).
//
// An e2m1 code is a sign bit (bit 3), two exponent bits and one mantissa bit: codes 0..7 are 0, 0.5, 1, 1.5, 2, 3,
// 4, 6 and code 8 + c is -(code c) (code 8 is -0, as in the NumPy tables).  Its three low bits placed in bits 9..11
// of a half (the exponent's two low bits and the mantissa's top bit) and its sign in bit 15 make a half of 2^-14
// times its value (subnormal for codes 0, 1): one mul.f16x2 by 2^14 then gives two values at once, exactly (halves
// keep their subnormals without .ftz), and a half converts to fp32 exactly.  The modules that use this file put it
// after common.cu and remove the include lines (kernels/nvrtc.py joined_source); the include guard lets a .cu file
// include it on its own (nvcc -ptx).
#ifndef METRALE_E2M1_CU
#define METRALE_E2M1_CU

// The eight e2m1 codes of a 32-bit word (code i in bits 4 i .. 4 i + 3: two a byte, the low nibble first, read as a
// little-endian word) in order, times 2^D, exactly: D = 0 their values, D = 1 twice them (-12..12, integers).
template <int D>
__device__ __forceinline__ void e2m1x8(unsigned int word, float (&v)[8]) {
    const unsigned int scale = D ? 0x78007800u : 0x74007400u;  // 2^15 or 2^14, as two halves
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int t = word >> (4 * i);  // code i in bits 0..3, code i + 4 in bits 16..19
        unsigned int h = ((t << 9) & 0x0e000e00u) | ((t << 12) & 0x80008000u);
        asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(h) : "r"(scale));
        asm("cvt.f32.f16 %0, %1;" : "=f"(v[i]) : "h"((unsigned short)(h & 0xffffu)));
        asm("cvt.f32.f16 %0, %1;" : "=f"(v[i + 4]) : "h"((unsigned short)(h >> 16)));
    }
}

#endif  // METRALE_E2M1_CU
