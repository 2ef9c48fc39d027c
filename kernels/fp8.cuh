// The FP8 wire format's element rules, shared by fp8.cu (quantize / dequantize
// fused with the row expansions) and peer.cu (the quantize fused with the peer
// dispatch). Prepended after common.cuh to the files that use it
// (moe_ep/transport/kernel_source.py). The format and its rules (power-of-two
// scales, scale floor, NaN/inf blocks) are documented in
// moe_ep/transport/fp8.py, whose pure-JAX functions give the same bytes.
//
// Wire row of H channels, W bytes (W and Hc multiples of 16, B = ceil(H/128)):
//   [0, H) codes | [H, Hc) zero | [Hc, Hc + 4B) float32 scales | [.., W) zero
// with Hc = round_up(H, 16), W = round_up(Hc + 4B, 16).
//
// The e4m3 conversions use the sm_89+ PTX cvt instructions (the ones
// <cuda_fp8.h>'s __nv_cvt_float2_to_fp8x2 emits there). Compiled for an older
// GPU they are left out, so that peer.cu still builds there; Python never
// launches an FP8 kernel on such a GPU (fp8.check_compute_capability).

#define FP8_BLOCK 128
#define FP8_MAX 448.0f
#define FP8_MIN_SCALE_EXPONENT (-116)  // as MIN_SCALE_EXPONENT in fp8.py
#define FP8_NAN_CODE 0x7fu
#define FP8_CANONICAL_NAN 0x7fc00000u
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define FP8_HAS_E4M3 1
#else
#define FP8_HAS_E4M3 0
#endif

typedef unsigned char u8;

// max(ceil(log2(amax / 448)), -116) of a finite amax >= 0, from its bits: with
// amax = m * 2^E, m in [1, 2), it is E - 8, plus one where m > 1.75.
__device__ __forceinline__ int fp8_scale_exponent(float amax) {
  const u32 bits = __float_as_uint(amax);
  const int exponent = (int)(bits >> 23) - 127 - 8 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0);
  return max(exponent, FP8_MIN_SCALE_EXPONENT);
}

__device__ __forceinline__ float fp8_pow2(int exponent) {  // exponent in [-126, 127]
  return __uint_as_float((u32)(exponent + 127) << 23);
}

__device__ __forceinline__ bool fp8_is_finite(float value) {
  return (__float_as_uint(value) & 0x7f800000u) != 0x7f800000u;
}

// Two float32 -> two e4m3fn codes, round to nearest even, saturating; `lo`
// goes to the low byte.
__device__ __forceinline__ u32 f32x2_to_e4m3x2(float lo, float hi) {
#if FP8_HAS_E4M3
  unsigned short codes;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(codes) : "f"(hi), "f"(lo));
  return codes;
#else
  return 0u;  // not launched below sm_89 (see the top)
#endif
}

// Two e4m3fn codes (low byte first) -> two float32, exactly (through f16x2).
__device__ __forceinline__ void e4m3x2_to_f32x2(u32 codes, float* lo, float* hi) {
#if FP8_HAS_E4M3
  u32 halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"((unsigned short)codes));
  *lo = f16_to_f32((u16)(halves & 0xffffu));
  *hi = f16_to_f32((u16)(halves >> 16));
#else
  *lo = *hi = 0.0f;  // not launched below sm_89 (see the top)
#endif
}

__device__ __forceinline__ int fp8_code_bytes(int hidden) { return (hidden + 15) & ~15; }
