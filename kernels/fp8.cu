// FP8 dispatch rows: quantize token rows into wire rows (float8_e4m3fn codes
// plus one float32 scale per 128 channels) and dequantize wire rows into slab
// rows, each fused with the row expansion of rows.cu's expand_rows so the
// quantization costs no extra pass over the rows. The wire format and the
// element rules are fp8.cuh's (included below); with power-of-two
// scales every step but the e4m3 and output roundings is exact, so no
// division or reciprocal can differ from moe_ep/transport/fp8.py's pure JAX.

#include "common.cuh"
#include "fp8.cuh"

#define FP8_ZERO_ROWS_PER_BLOCK 8
#define FP8_CODES_PER_THREAD 16

// Zero-fills the output rows n of zero-fill group `group` whose source is
// outside [0, num_in_rows); rows of row_elems elements, in 16-byte stores when
// the row size allows.
template <typename Elem>
__device__ __forceinline__ void fp8_zero_rows(const int* __restrict__ sources,
                                              Elem* __restrict__ out, i64 group, int num_in_rows,
                                              int num_out_rows, int row_elems) {
  const i64 first = group * FP8_ZERO_ROWS_PER_BLOCK;
  const bool vectors = (row_elems * sizeof(Elem)) % 16 == 0;
  for (int r = 0; r < FP8_ZERO_ROWS_PER_BLOCK; ++r) {
    const i64 n = first + r;
    if (n >= num_out_rows) return;
    const int m = __ldg(sources + n);
    if (m >= 0 && m < num_in_rows) continue;
    Elem* dst = out + n * row_elems;
    if (vectors) {
      const uint4 zero{0u, 0u, 0u, 0u};
      const int row_vecs = row_elems * (int)sizeof(Elem) / 16;
      for (int v = threadIdx.x; v < row_vecs; v += blockDim.x)
        reinterpret_cast<uint4*>(dst)[v] = zero;
    } else {
      for (int e = threadIdx.x; e < row_elems; e += blockDim.x) dst[e] = Elem(0);
    }
  }
}

// ---------------------------------------------------------------------------
// quantize_pack_{f32,bf16,f16}: wire[n] = quantize(x[m]) for every (m, j)
// with targets[m * fanout + j] == n; wire rows n whose sources[n] is outside
// [0, num_rows) are all zero. With targets == sources == NULL the map is the
// identity (wire row m = quantize(x[m]), num_out_rows == num_rows).
//   grid:   num_rows blocks, plus ceil(num_out_rows / 8) zero-fill blocks when
//           the maps are given; block b < num_rows quantizes x row b once.
//   block:  a multiple of 32 threads; warp w handles scale blocks w, w +
//           warps, ...; lane l channels 128 * block + 4 * l + [0, 4), the amax
//           and the all-finite test reduced over the warp by shuffles.
//   inputs: x [num_rows, hidden], targets [num_rows, fanout] int32, sources
//           [num_out_rows] int32.
//   output: wire [num_out_rows, wire_bytes] uint8 (layout at the top).
//   bounds: channels >= hidden read as 0 and write code 0; a target outside
//           [0, num_out_rows) is skipped; a source outside [0, num_rows)
//           means "zero row". Every byte of every written row is written.
//           Vector loads only when hidden % 4 == 0.
// ---------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void load_quad(const typename T::Elem* __restrict__ row, int c,
                                          int hidden, float v[4]) {
  if ((hidden & 3) == 0 && c < hidden) {  // c + 3 < hidden, 4-element aligned
    if (sizeof(typename T::Elem) == 4) {
      const float4 q = *reinterpret_cast<const float4*>(row + c);
      v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
      const uint2 q = *reinterpret_cast<const uint2*>(row + c);
      const typename T::Elem* e = reinterpret_cast<const typename T::Elem*>(&q);
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = T::load(e[i]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = c + i < hidden ? T::load(row[c + i]) : 0.0f;
}

template <typename T>
__device__ __forceinline__ void quantize_pack(const typename T::Elem* __restrict__ x,
                                              const int* __restrict__ targets,
                                              const int* __restrict__ sources,
                                              u8* __restrict__ wire, int num_rows, int fanout,
                                              int num_out_rows, int hidden, int wire_bytes) {
  const i64 block = blockIdx.x;
  if (block >= num_rows) {
    if (sources != nullptr)
      fp8_zero_rows(sources, wire, block - num_rows, num_rows, num_out_rows, wire_bytes);
    return;
  }
  const int blocks = (hidden + FP8_BLOCK - 1) / FP8_BLOCK;
  const int code_bytes = fp8_code_bytes(hidden);
  const int copies = targets != nullptr ? fanout : 1;
  const typename T::Elem* row = x + block * hidden;
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  for (int b = threadIdx.x >> 5; b < blocks; b += warps) {
    const int c = b * FP8_BLOCK + 4 * lane;
    float v[4];
    load_quad<T>(row, c, hidden, v);
    float amax = fp8_lane_amax(v);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      amax = fp8_max_nan(amax, __shfl_xor_sync(MOE_EP_FULL_MASK, amax, offset));
    u32 words[1];
    const float scale = __uint_as_float(fp8_quantize_block(v, amax, words));
    const int in_row = hidden - c;  // channels past the row keep code 0 (the code padding)
    const u32 codes = in_row >= 4 ? words[0] : in_row > 0 ? words[0] & ((1u << (8 * in_row)) - 1u)
                                                          : 0u;
    for (int j = 0; j < copies; ++j) {
      const i64 n = targets != nullptr ? __ldg(targets + block * fanout + j) : block;
      if (n < 0 || n >= num_out_rows) continue;
      u8* dst = wire + n * wire_bytes;
      if (c < code_bytes) *reinterpret_cast<u32*>(dst + c) = codes;  // c + 3 < code_bytes
      if (lane == 0) *reinterpret_cast<float*>(dst + code_bytes + 4 * b) = scale;
    }
  }
  const int tail = code_bytes + 4 * blocks;  // zero padding [tail, wire_bytes)
  for (int w = threadIdx.x; w < (wire_bytes - tail) / 4; w += blockDim.x) {
    for (int j = 0; j < copies; ++j) {
      const i64 n = targets != nullptr ? __ldg(targets + block * fanout + j) : block;
      if (n < 0 || n >= num_out_rows) continue;
      *reinterpret_cast<u32*>(wire + n * wire_bytes + tail + 4 * w) = 0u;
    }
  }
}

#define DEFINE_QUANTIZE_PACK(NAME, TYPE)                                                       \
  extern "C" __global__ void NAME(const TYPE::Elem* x, const int* targets, const int* sources, \
                                  u8* wire, int num_rows, int fanout, int num_out_rows,        \
                                  int hidden, int wire_bytes) {                                \
    quantize_pack<TYPE>(x, targets, sources, wire, num_rows, fanout, num_out_rows, hidden,     \
                        wire_bytes);                                                           \
  }

DEFINE_QUANTIZE_PACK(quantize_pack_f32, F32)
DEFINE_QUANTIZE_PACK(quantize_pack_bf16, BF16)
DEFINE_QUANTIZE_PACK(quantize_pack_f16, F16)

// ---------------------------------------------------------------------------
// unpack_dequantize_expand_{f32,bf16,f16}: out[n] = dequantize(wire[m]) for
// every (m, j) with targets[m * fanout + j] == n, i.e. float32(code) * scale
// rounded once to the output type; out rows n whose sources[n] is outside
// [0, num_wire_rows) are zero. With targets == sources == NULL the map is the
// identity (a plain dequantize, num_out_rows == num_wire_rows).
//   grid:   num_wire_rows blocks, plus ceil(num_out_rows / 8) zero-fill
//           blocks when the maps are given; block b < num_wire_rows reads wire
//           row b once, and not at all where no target of it is in range
//           (dequantize_filled_rows: the unfilled rows of FP8 slabs).
//   block:  a multiple of 32 threads; each thread takes 16 channels at a time
//           (one 16-byte load of codes, all inside one scale block).
//   inputs: wire [num_wire_rows, wire_bytes] uint8, targets [num_wire_rows,
//           fanout] int32, sources [num_out_rows] int32.
//   output: out [num_out_rows, hidden].
//   bounds: channels >= hidden are neither read as codes nor written; a target
//           outside [0, num_out_rows) is skipped; a source outside
//           [0, num_wire_rows) means "zero row". 16-byte stores only when
//           hidden % 8 == 0 and all 16 channels are in range.
// ---------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void store_sixteen(typename T::Elem* __restrict__ row, int c,
                                              int hidden, const float v[16]) {
  typedef typename T::Elem Elem;
  if ((hidden & 7) == 0 && c + 16 <= hidden) {
    constexpr int kPerVec = 16 / sizeof(Elem);
    union {
      uint4 raw[16 / kPerVec];
      Elem elems[16];
    } pack;
#pragma unroll
    for (int i = 0; i < 16; ++i) pack.elems[i] = T::store(v[i]);
    uint4* dst = reinterpret_cast<uint4*>(row + c);
#pragma unroll
    for (int k = 0; k < 16 / kPerVec; ++k) dst[k] = pack.raw[k];
    return;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if (c + i < hidden) row[c + i] = T::store(v[i]);
}

template <typename T>
__device__ __forceinline__ void unpack_dequantize_expand(
    const u8* __restrict__ wire, const int* __restrict__ targets, const int* __restrict__ sources,
    typename T::Elem* __restrict__ out, int num_wire_rows, int fanout, int num_out_rows,
    int hidden, int wire_bytes) {
  typedef typename T::Elem Elem;
  const i64 block = blockIdx.x;
  if (block >= num_wire_rows) {
    if (sources != nullptr)
      fp8_zero_rows(sources, out, block - num_wire_rows, num_wire_rows, num_out_rows, hidden);
    return;
  }
  const int copies = targets != nullptr ? fanout : 1;
  if (targets != nullptr) {  // a row no target takes is not read (its codes may be unwritten)
    bool taken = false;
    for (int j = 0; j < copies; ++j) {
      const i64 n = __ldg(targets + block * fanout + j);
      taken = taken || (n >= 0 && n < num_out_rows);
    }
    if (!taken) return;  // block-uniform: every thread reads the same targets
  }
  const u8* src = wire + block * wire_bytes;
  const float* scales = reinterpret_cast<const float*>(src + fp8_code_bytes(hidden));
  for (int c = FP8_CODES_PER_THREAD * threadIdx.x; c < hidden;
       c += FP8_CODES_PER_THREAD * blockDim.x) {
    const uint4 codes = *reinterpret_cast<const uint4*>(src + c);  // c + 16 <= code_bytes
    const float scale = __ldg(scales + c / FP8_BLOCK);
    const u32 words[4] = {codes.x, codes.y, codes.z, codes.w};
    float v[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      e4m3x2_to_f32x2(words[k], &v[4 * k], &v[4 * k + 1]);
      e4m3x2_to_f32x2(words[k] >> 16, &v[4 * k + 2], &v[4 * k + 3]);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] *= scale;
    for (int j = 0; j < copies; ++j) {
      const i64 n = targets != nullptr ? __ldg(targets + block * fanout + j) : block;
      if (n < 0 || n >= num_out_rows) continue;
      store_sixteen<T>(out + n * hidden, c, hidden, v);
    }
  }
}

#define DEFINE_UNPACK_DEQUANTIZE_EXPAND(NAME, TYPE)                                             \
  extern "C" __global__ void NAME(const u8* wire, const int* targets, const int* sources,       \
                                  TYPE::Elem* out, int num_wire_rows, int fanout,               \
                                  int num_out_rows, int hidden, int wire_bytes) {               \
    unpack_dequantize_expand<TYPE>(wire, targets, sources, out, num_wire_rows, fanout,          \
                                   num_out_rows, hidden, wire_bytes);                           \
  }

DEFINE_UNPACK_DEQUANTIZE_EXPAND(unpack_dequantize_expand_f32, F32)
DEFINE_UNPACK_DEQUANTIZE_EXPAND(unpack_dequantize_expand_bf16, BF16)
DEFINE_UNPACK_DEQUANTIZE_EXPAND(unpack_dequantize_expand_f16, F16)
