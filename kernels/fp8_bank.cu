// The FP8 expert bank's passes outside its GEMMs, each one read of its inputs and
// one write of every quantization of its output (moe_ep/experts/fp8_passes.py
// launches them; its pure-JAX functions are the reference):
//
//   fp8_act_quantize_<act>:      hidden [M, nF] -> a = act(hidden) (* w), rounded
//                                to bf16 once, quantized per row and 128 channels
//                                ([M, F] codes) and per channel and 128 rows
//                                ([F, M] codes: the weight gradient's operand);
//   fp8_act_grad_quantize_<act>: hidden, da [M, F] -> dh = da * d act / d hidden,
//                                rounded to bf16 once, quantized both ways
//                                ([M, nF] and [nF, M]); with routing weights w
//                                also each row's partial sums of da * act per
//                                128-channel block (the gradient of w, summed
//                                by the caller in a fixed order).
//   fp8_quantize_weights_<dtype>: w [G, K, N] -> codes per 128 x 128 block, as
//                                they are ([G, K, N]: the input gradient's
//                                operand) and transposed ([G, N, K]: the
//                                forward's), and one scale per block.
//
// gate | up halves of hidden for the gated activations (n = 2), as
// moe_ep/activations.py splits them; all arithmetic in float32, from the
// bf16 inputs' exact values. The scale rule is fp8.cuh's (fp8_quantize_block).
//
//   grid:   (M / 128) * (channel blocks of the output) CTAs, one per 128 x 128
//           output tile, a row tile's blocks side by side: its rows are one column scale block and its columns
//           one row scale block (the last partial where the width is not a
//           multiple of 128). The backward's tiles run in an order that puts
//           each gate block beside the up block of the same source columns,
//           so the two read hidden and da while the other's reads are in L2.
//   block:  256 threads (8 warps). Rows: warp w takes the tile's rows 16w ..
//           16w + 15, lane l the channels 4l .. 4l + 3 of each (one warp, one
//           scale block). Columns: from the tile kept in shared memory as
//           bf16, warp w takes column pairs w, w + 8, ..., lane l the rows
//           l, l + 32, l + 64, l + 96 (one warp, one column scale block).
//   bounds: M % 128 == 0, F % 16 == 0 (the caller checks; a CTA outside the
//           grid's tiles returns); channels past the width read as 0 and are
//           never written. Every code and scale of the outputs is written.

#include "common.cuh"
#include "fp8.cuh"

#define BANK_TILE 128
#define BANK_THREADS 256
#define BANK_ROWS_PER_WARP 16
#define BANK_TILE_WORDS 65  // a tile row of 128 bf16 as 32-bit words, +1: columns without conflicts

enum { ACT_SWIGLU = 0, ACT_GEGLU = 1, ACT_GELU = 2 };

__device__ __forceinline__ float bank_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// jax.nn.gelu(approximate=True) and its derivative.
#define BANK_GELU_K 0.7978845608028654f  // sqrt(2 / pi)
#define BANK_GELU_C 0.044715f
__device__ __forceinline__ float bank_gelu(float x) {
  return x * (0.5f * (1.0f + tanhf(BANK_GELU_K * (x + BANK_GELU_C * x * x * x))));
}
__device__ __forceinline__ float bank_gelu_grad(float x) {
  const float t = tanhf(BANK_GELU_K * (x + BANK_GELU_C * x * x * x));
  return 0.5f * (1.0f + t) +
         0.5f * x * (1.0f - t * t) * BANK_GELU_K * (1.0f + 3.0f * BANK_GELU_C * x * x);
}

// The gate's own activation: silu or gelu.
template <int ACT>
__device__ __forceinline__ float bank_gate(float g) {
  return ACT == ACT_SWIGLU ? g * bank_sigmoid(g) : bank_gelu(g);
}
template <int ACT>
__device__ __forceinline__ float bank_gate_grad(float g) {
  if (ACT == ACT_SWIGLU) {
    const float s = bank_sigmoid(g);
    return s * (1.0f + g * (1.0f - s));
  }
  return bank_gelu_grad(g);
}

__device__ __forceinline__ void bank_load_quad(const u16* __restrict__ src, float v[4]) {
  const uint2 q = *reinterpret_cast<const uint2*>(src);  // 8-byte aligned: F % 16 == 0
  v[0] = bf16_to_f32((u16)(q.x & 0xffffu));
  v[1] = bf16_to_f32((u16)(q.x >> 16));
  v[2] = bf16_to_f32((u16)(q.y & 0xffffu));
  v[3] = bf16_to_f32((u16)(q.y >> 16));
}

// One row of the tile, quad by quad: rounds the lane's four float32 values
// to bf16 (v then holds the rounded values), keeps them in the tile, and
// writes their row codes and (lane 0) the row block's scale.
__device__ __forceinline__ void bank_row_quantize(float (&v)[4], bool inside, u32* tile_row,
                                                  u8* __restrict__ codes, float* __restrict__ scale) {
  u16 b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    b[i] = inside ? f32_to_bf16(v[i]) : (u16)0;
    v[i] = bf16_to_f32(b[i]);
  }
  const int lane = threadIdx.x & 31;
  tile_row[2 * lane] = (u32)b[0] | ((u32)b[1] << 16);
  tile_row[2 * lane + 1] = (u32)b[2] | ((u32)b[3] << 16);
  float amax = fp8_lane_amax(v);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    amax = fp8_max_nan(amax, __shfl_xor_sync(MOE_EP_FULL_MASK, amax, offset));
  u32 words[1];
  const u32 bits = fp8_quantize_block(v, amax, words);
  if (inside) *reinterpret_cast<u32*>(codes) = words[0];  // 4-byte aligned: F % 4 == 0
  if (lane == 0) *scale = __uint_as_float(bits);
}

// The tile's columns: each column's 128 values (the tile's rows) one scale
// block, its codes written as 128 contiguous bytes of the transposed output.
__device__ __forceinline__ void bank_column_quantize(const u32* tile, int first_column, int width,
                                                     int num_rows, int row_tile,
                                                     u8* __restrict__ codes,
                                                     float* __restrict__ scales) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_blocks = num_rows / BANK_TILE;
  for (int pair = warp; pair < BANK_TILE / 2; pair += BANK_THREADS / 32) {
    const int c = first_column + 2 * pair;
    if (c >= width) break;  // width is even: both columns in, or both out
    float lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 word = tile[(lane + 32 * i) * BANK_TILE_WORDS + pair];
      lo[i] = bf16_to_f32((u16)(word & 0xffffu));
      hi[i] = bf16_to_f32((u16)(word >> 16));
    }
    float amax_lo = fp8_lane_amax(lo), amax_hi = fp8_lane_amax(hi);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      amax_lo = fp8_max_nan(amax_lo, __shfl_xor_sync(MOE_EP_FULL_MASK, amax_lo, offset));
      amax_hi = fp8_max_nan(amax_hi, __shfl_xor_sync(MOE_EP_FULL_MASK, amax_hi, offset));
    }
    u32 words_lo[1], words_hi[1];
    const u32 scale_lo = fp8_quantize_block(lo, amax_lo, words_lo);
    const u32 scale_hi = fp8_quantize_block(hi, amax_hi, words_hi);
    u8* column_lo = codes + (i64)c * num_rows + (i64)row_tile * BANK_TILE + lane;
    u8* column_hi = column_lo + num_rows;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // byte i of a word: row lane + 32 i
      column_lo[32 * i] = (u8)(words_lo[0] >> (8 * i));
      column_hi[32 * i] = (u8)(words_hi[0] >> (8 * i));
    }
    if (lane == 0) scales[(i64)c * row_blocks + row_tile] = __uint_as_float(scale_lo);
    if (lane == 1) scales[(i64)(c + 1) * row_blocks + row_tile] = __uint_as_float(scale_hi);
  }
}

// ---------------------------------------------------------------------------
// fp8_act_quantize_<act>
//   inputs: hidden [num_rows, n * ffn] bf16 (n = 2: gate | up), row_weights
//           [num_rows] float32 or NULL.
//   output: row_codes [num_rows, ffn] e4m3, row_scales [num_rows, ceil(ffn /
//           128)] float32, column_codes [ffn, num_rows], column_scales [ffn,
//           num_rows / 128].
// ---------------------------------------------------------------------------
template <int ACT>
__device__ __forceinline__ void act_quantize(const u16* __restrict__ hidden,
                                             const float* __restrict__ row_weights, int num_rows,
                                             int ffn, u8* __restrict__ row_codes,
                                             float* __restrict__ row_scales,
                                             u8* __restrict__ column_codes,
                                             float* __restrict__ column_scales) {
  __shared__ u32 tile[BANK_TILE * BANK_TILE_WORDS];
  const int blocks = (ffn + BANK_TILE - 1) / BANK_TILE;
  const int column_block = blockIdx.x % blocks, row_tile = blockIdx.x / blocks;
  if ((row_tile + 1) * BANK_TILE > num_rows) return;
  const bool gated = ACT != ACT_GELU;
  const int in_width = gated ? 2 * ffn : ffn;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = column_block * BANK_TILE + 4 * lane;
  const bool inside = c < ffn;  // ffn % 4 == 0: the whole quad
#pragma unroll 4
  for (int k = 0; k < BANK_ROWS_PER_WARP; ++k) {
    const int local = warp * BANK_ROWS_PER_WARP + k;
    const i64 r = (i64)row_tile * BANK_TILE + local;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (inside) {
      float g[4], u[4];
      bank_load_quad(hidden + r * in_width + c, g);
      if (gated) bank_load_quad(hidden + r * in_width + ffn + c, u);
      const float w = row_weights != nullptr ? row_weights[r] : 1.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float a = gated ? bank_gate<ACT>(g[i]) * u[i] : bank_gelu(g[i]);
        v[i] = row_weights != nullptr ? a * w : a;
      }
    }
    bank_row_quantize(v, inside, tile + local * BANK_TILE_WORDS, row_codes + r * ffn + c,
                      row_scales + r * blocks + column_block);
  }
  __syncthreads();
  bank_column_quantize(tile, column_block * BANK_TILE, ffn, num_rows, row_tile, column_codes,
                       column_scales);
}

// ---------------------------------------------------------------------------
// fp8_act_grad_quantize_<act>
//   inputs: hidden [num_rows, n * ffn] bf16, act_grad [num_rows, ffn] bf16
//           (the activation output's cotangent), row_weights [num_rows]
//           float32 or NULL.
//   output: row_codes [num_rows, n * ffn], row_scales [num_rows, ceil(n *
//           ffn / 128)], column_codes [n * ffn, num_rows], column_scales
//           [n * ffn, num_rows / 128]; with row_weights, weight_partials
//           [num_rows, ceil(n * ffn / 128)] float32: per output block the
//           sum over its gate (or, ungated, all) columns of act_grad * act,
//           zero for a block of up columns only.
// ---------------------------------------------------------------------------
template <int ACT>
__device__ __forceinline__ void act_grad_quantize(
    const u16* __restrict__ hidden, const u16* __restrict__ act_grad,
    const float* __restrict__ row_weights, int num_rows, int ffn, u8* __restrict__ row_codes,
    float* __restrict__ row_scales, u8* __restrict__ column_codes,
    float* __restrict__ column_scales, float* __restrict__ weight_partials) {
  __shared__ u32 tile[BANK_TILE * BANK_TILE_WORDS];
  const bool gated = ACT != ACT_GELU;
  const int width = gated ? 2 * ffn : ffn;
  const int blocks = (width + BANK_TILE - 1) / BANK_TILE;
  const int row_tile = blockIdx.x / blocks;
  if ((row_tile + 1) * BANK_TILE > num_rows) return;
  // Pairs (gate block k, up block gate_blocks + k) side by side, then the rest.
  const int gate_blocks = (ffn + BANK_TILE - 1) / BANK_TILE;
  const int pairs = min(gate_blocks, blocks - gate_blocks);
  const int i = blockIdx.x % blocks;
  const int column_block = i < 2 * pairs ? ((i & 1) ? gate_blocks + (i >> 1) : (i >> 1))
                                         : i - pairs;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = column_block * BANK_TILE + 4 * lane;  // output column
  const bool inside = j < width;
  const bool gate_part = j < ffn;  // ffn % 4 == 0: the whole quad in one part
  const int s = gate_part ? j : j - ffn;  // source column
#pragma unroll 4
  for (int k = 0; k < BANK_ROWS_PER_WARP; ++k) {
    const int local = warp * BANK_ROWS_PER_WARP + k;
    const i64 r = (i64)row_tile * BANK_TILE + local;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float weight_partial = 0.0f;
    if (inside) {
      float g[4], u[4] = {1.0f, 1.0f, 1.0f, 1.0f}, d[4];
      bank_load_quad(hidden + r * width + s, g);
      if (gated) bank_load_quad(hidden + r * width + ffn + s, u);
      bank_load_quad(act_grad + r * ffn + s, d);
      const float w = row_weights != nullptr ? row_weights[r] : 1.0f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float dw = row_weights != nullptr ? d[e] * w : d[e];
        const float gate = gated ? bank_gate<ACT>(g[e]) : bank_gelu(g[e]);
        if (gate_part) {
          const float slope = gated ? bank_gate_grad<ACT>(g[e]) : bank_gelu_grad(g[e]);
          v[e] = gated ? dw * u[e] * slope : dw * slope;
          weight_partial += d[e] * (gated ? gate * u[e] : gate);
        } else {
          v[e] = dw * gate;
        }
      }
    }
    if (weight_partials != nullptr) {
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1)  // a fixed order: deterministic
        weight_partial += __shfl_xor_sync(MOE_EP_FULL_MASK, weight_partial, offset);
      if (lane == 0) weight_partials[r * blocks + column_block] = weight_partial;
    }
    bank_row_quantize(v, inside, tile + local * BANK_TILE_WORDS, row_codes + r * width + j,
                      row_scales + r * blocks + column_block);
  }
  __syncthreads();
  bank_column_quantize(tile, column_block * BANK_TILE, width, num_rows, row_tile, column_codes,
                       column_scales);
}

#define MOE_EP_BANK_KERNELS(act, ACT)                                                        \
  extern "C" __global__ void __launch_bounds__(BANK_THREADS) fp8_act_quantize_##act(          \
      const u16* hidden, const float* row_weights, int num_rows, int ffn, u8* row_codes,     \
      float* row_scales, u8* column_codes, float* column_scales) {                           \
    act_quantize<ACT>(hidden, row_weights, num_rows, ffn, row_codes, row_scales,            \
                      column_codes, column_scales);                                         \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(BANK_THREADS) fp8_act_grad_quantize_##act(     \
      const u16* hidden, const u16* act_grad, const float* row_weights, int num_rows,       \
      int ffn, u8* row_codes, float* row_scales, u8* column_codes, float* column_scales,    \
      float* weight_partials) {                                                              \
    act_grad_quantize<ACT>(hidden, act_grad, row_weights, num_rows, ffn, row_codes,         \
                           row_scales, column_codes, column_scales, weight_partials);       \
  }

// ---------------------------------------------------------------------------
// fp8_quantize_weights_{f32,bf16}
//   grid:   G * ceil(K / 128) * ceil(N / 128) CTAs, one per 128 x 128 block
//           (partial at the edges); warp w takes the block's rows 16w ..
//           16w + 15, lane l the columns 4l .. 4l + 3 of each, kept in
//           registers while the block's amax is reduced (warps, then shared
//           memory); the transposed codes from the codes in shared memory,
//           lane l the rows l, l + 32, l + 64, l + 96 of each column.
//   input:  weights [G, K, N] (K % 16 == 0, N % 16 == 0: the caller checks).
//   output: codes [G, K, N] e4m3, codes_t [G, N, K], scales [G, ceil(K / 128),
//           ceil(N / 128)] float32: fp8.cuh's rule over the whole block,
//           the bytes of moe_ep/fp8_blocks.py's quantize (no rounding but
//           the e4m3 one: power-of-two scales).
// ---------------------------------------------------------------------------
#define WEIGHT_TILE_BYTES 132  // a block row of 128 codes, +4: aligned words

template <typename T>
__device__ __forceinline__ void quantize_weights(const typename T::Elem* __restrict__ weights,
                                                 int groups, int k_size, int n_size,
                                                 u8* __restrict__ codes,
                                                 u8* __restrict__ codes_t,
                                                 float* __restrict__ scales) {
  __shared__ u32 tile[BANK_TILE * WEIGHT_TILE_BYTES / 4];
  __shared__ float warp_amax[BANK_THREADS / 32];
  const int k_blocks = (k_size + BANK_TILE - 1) / BANK_TILE;
  const int n_blocks = (n_size + BANK_TILE - 1) / BANK_TILE;
  const int n_block = blockIdx.x % n_blocks;
  const int k_block = (blockIdx.x / n_blocks) % k_blocks;
  const int group = blockIdx.x / (n_blocks * k_blocks);
  if (group >= groups) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = n_block * BANK_TILE + 4 * lane;
  const bool inside_n = n < n_size;  // n_size % 4 == 0: the whole quad
  const i64 matrix = (i64)group * k_size * n_size;
  float v[BANK_ROWS_PER_WARP][4];
  float amax = 0.0f;
#pragma unroll
  for (int r = 0; r < BANK_ROWS_PER_WARP; ++r) {
    const int k = k_block * BANK_TILE + warp * BANK_ROWS_PER_WARP + r;
    if (inside_n && k < k_size) {
      const typename T::Elem* src = weights + matrix + (i64)k * n_size + n;
#pragma unroll
      for (int i = 0; i < 4; ++i) v[r][i] = T::load(src[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[r][i] = 0.0f;
    }
    amax = fp8_max_nan(amax, fp8_lane_amax(v[r]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    amax = fp8_max_nan(amax, __shfl_xor_sync(MOE_EP_FULL_MASK, amax, offset));
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < BANK_THREADS / 32; ++w) amax = fp8_max_nan(amax, warp_amax[w]);
  u8* tile_bytes = reinterpret_cast<u8*>(tile);
  u32 scale = 0u;
#pragma unroll
  for (int r = 0; r < BANK_ROWS_PER_WARP; ++r) {
    const int local = warp * BANK_ROWS_PER_WARP + r;
    const int k = k_block * BANK_TILE + local;
    u32 words[1];
    scale = fp8_quantize_block(v[r], amax, words);
    *reinterpret_cast<u32*>(tile_bytes + local * WEIGHT_TILE_BYTES + 4 * lane) = words[0];
    if (inside_n && k < k_size)
      *reinterpret_cast<u32*>(codes + matrix + (i64)k * n_size + n) = words[0];
  }
  if (threadIdx.x == 0)
    scales[((i64)group * k_blocks + k_block) * n_blocks + n_block] = __uint_as_float(scale);
  __syncthreads();
  for (int c = warp; c < BANK_TILE; c += BANK_THREADS / 32) {
    const int column = n_block * BANK_TILE + c;
    if (column >= n_size) break;
    u8* dst = codes_t + matrix + (i64)column * k_size + k_block * BANK_TILE;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int local = lane + 32 * i;
      if (k_block * BANK_TILE + local < k_size)
        dst[local] = tile_bytes[local * WEIGHT_TILE_BYTES + c];
    }
  }
}

#define MOE_EP_WEIGHT_KERNEL(suffix, T)                                                      \
  extern "C" __global__ void __launch_bounds__(BANK_THREADS) fp8_quantize_weights_##suffix(   \
      const T::Elem* weights, int groups, int k_size, int n_size, u8* codes, u8* codes_t,   \
      float* scales) {                                                                      \
    quantize_weights<T>(weights, groups, k_size, n_size, codes, codes_t, scales);            \
  }

MOE_EP_WEIGHT_KERNEL(f32, F32)
MOE_EP_WEIGHT_KERNEL(bf16, BF16)

MOE_EP_BANK_KERNELS(swiglu, ACT_SWIGLU)
MOE_EP_BANK_KERNELS(geglu, ACT_GEGLU)
MOE_EP_BANK_KERNELS(gelu, ACT_GELU)
