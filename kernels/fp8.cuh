// The FP8 wire format's element rules, shared by fp8.cu (quantize / dequantize
// fused with the row expansions) and peer_dispatch.cu (the quantize fused with the peer
// dispatch). The format and its rules (power-of-two
// scales, scale floor, NaN/inf blocks) are documented in
// moe_ep/transport/fp8.py, whose pure-JAX functions give the same bytes.
//
// Wire row of H channels, W bytes (B = ceil(H/128)):
//   [0, H) codes | [H, Hc) zero | [Hc, Hc + 4B) float32 scales | [.., W) zero
// with Hc = round_up(H, 16) and W from the caller (fp8.py's wire_bytes, the
// one place its rule lives; every kernel takes W as an argument).
//
// The e4m3 conversions use the sm_89+ PTX cvt instructions (the ones
// <cuda_fp8.h>'s __nv_cvt_float2_to_fp8x2 emits there). Compiled for an older
// GPU they are left out, so that peer_dispatch.cu still builds there; Python never
// launches an FP8 kernel on such a GPU (fp8.check_compute_capability).

#ifndef MOE_EP_FP8_CUH
#define MOE_EP_FP8_CUH

#include "common.cuh"

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

// max(a, b), NaN if either is NaN (fmaxf would return the other): one
// instruction carries both a block's amax and whether it is finite.
__device__ __forceinline__ float fp8_max_nan(float a, float b) {
#if FP8_HAS_E4M3
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
#else
  return fmaxf(a, b);  // not launched below sm_89 (see the top)
#endif
}

// A lane's part of a block's amax: max |v[i]|, NaN if a value is NaN, inf
// if one is inf; reduced over the block's lanes with fp8_max_nan, the block
// is finite exactly when its amax is.
template <int N>
__device__ __forceinline__ float fp8_lane_amax(const float (&v)[N]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = fp8_max_nan(amax, fabsf(v[i]));
  return amax;
}

// Four values of a finite block -> their four codes (byte i for v[i]): times
// the block's power-of-two inverse scale (exact), rounded to e4m3 saturating
// at +-448 (which never binds with this scale).
__device__ __forceinline__ u32 fp8_codes4(const float* v, float inverse) {
  return f32x2_to_e4m3x2(v[0] * inverse, v[1] * inverse) |
         (f32x2_to_e4m3x2(v[2] * inverse, v[3] * inverse) << 16);
}

// The block-scale and NaN rule, the one place the kernels state it (the
// pure-JAX one: moe_ep/transport/fp8.py): quantizes 4 * W values of one scale
// block whose amax, reduced with fp8_max_nan, is NaN or inf exactly when the
// block holds a NaN or an inf. A finite block: scale 2^e with e =
// fp8_scale_exponent(amax), each value's code e4m3(value * 2^-e). A
// non-finite block ("non-finite in, NaN out"): scale NaN, every code
// FP8_NAN_CODE. Writes the codes four to a word (byte i of word w for
// v[4 * w + i]); returns the scale's float32 bits.
template <int W>
__device__ __forceinline__ u32 fp8_quantize_block(const float* v, float amax, u32 (&words)[W]) {
  const bool finite = fp8_is_finite(amax);
  u32 scale;
  if (finite) {
    const int exponent = fp8_scale_exponent(amax);
    scale = __float_as_uint(fp8_pow2(exponent));
    const float inverse = fp8_pow2(-exponent);
#pragma unroll
    for (int w = 0; w < W; ++w) words[w] = fp8_codes4(v + 4 * w, inverse);
  } else {
    scale = FP8_CANONICAL_NAN;
#pragma unroll
    for (int w = 0; w < W; ++w) words[w] = FP8_NAN_CODE * 0x01010101u;
  }
  return scale;
}

// --- one warp step of the quantize fused with the peer dispatch's senders ----
// Rows with hidden % 16 == 0: lane l takes channels c = 512 * step + 16 * l +
// [0, 16) (all in the row or all past it), so lanes 8j .. 8j + 7 hold scale
// block 4 * step + j, and the step's codes are 32 16-byte vectors of the wire
// row and its four scales one more. Same rules, hence the same bytes, as
// fp8.cu's quantize_pack.
#define FP8_STEP_CHANNELS 512

// The lane's 16 channels of step `step` of `row` as they are stored (16 *
// sizeof(Elem) bytes: sizeof(Elem) vectors); past the row, zeros. Loading
// several steps before widening any keeps more loads in flight.
template <typename T>
__device__ __forceinline__ void fp8_load_sixteen(const typename T::Elem* __restrict__ row,
                                                 int hidden, int step,
                                                 uint4 (&raw)[sizeof(typename T::Elem)]) {
  const int c = FP8_STEP_CHANNELS * step + 16 * (int)(threadIdx.x & 31u);
  const uint4* vectors = reinterpret_cast<const uint4*>(row + c);
#pragma unroll
  for (int k = 0; k < (int)sizeof(typename T::Elem); ++k)  // c + 16 <= hidden when c < hidden
    raw[k] = c < hidden ? vectors[k] : make_uint4(0u, 0u, 0u, 0u);
}

// Those 16 channels as float32.
template <typename T>
__device__ __forceinline__ void fp8_widen_sixteen(const uint4 (&raw)[sizeof(typename T::Elem)],
                                                  float (&v)[16]) {
  constexpr int kPerVec = 16 / sizeof(typename T::Elem);
#pragma unroll
  for (int k = 0; k < (int)sizeof(typename T::Elem); ++k) {
    Pack16<T> pack;
    pack.raw = raw[k];
#pragma unroll
    for (int e = 0; e < kPerVec; ++e) v[k * kPerVec + e] = T::load(pack.elems[e]);
  }
}

// Quantizes the lane's 16 values of step `step` (warp-wide: every lane calls
// it). Returns its 16 codes, byte i for channel c + i; *scales: the step's four
// block scales as float32 bits (0 for blocks past the row), in every lane. A
// block holding a NaN or inf: scale NaN, codes 0x7f.
__device__ __forceinline__ uint4 fp8_quantize_sixteen(const float (&v)[16], int hidden, int step,
                                                      uint4* scales) {
  float amax = fp8_lane_amax(v);
#pragma unroll
  for (int offset = 4; offset > 0; offset >>= 1)  // over the block's 8 lanes
    amax = fp8_max_nan(amax, __shfl_xor_sync(MOE_EP_FULL_MASK, amax, offset));
  u32 words[4];
  const u32 scale = fp8_quantize_block(v, amax, words);
  const uint4 codes = make_uint4(words[0], words[1], words[2], words[3]);
  const int blocks = (hidden + FP8_BLOCK - 1) / FP8_BLOCK;
  u32 s[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    s[j] = __shfl_sync(MOE_EP_FULL_MASK, scale, 8 * j);
    if (4 * step + j >= blocks) s[j] = 0u;
  }
  *scales = make_uint4(s[0], s[1], s[2], s[3]);
  return codes;
}

#endif  // MOE_EP_FP8_CUH
