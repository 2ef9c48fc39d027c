// Row movement of dispatch and combine: copies and fixed-order sums of whole
// rows, driven by the int32 maps of the routing handle. Memory-bound: each
// kernel reads every input row once and writes every output row once, in
// 16-byte vectors when the row width allows.

#include "common.cuh"

// ---------------------------------------------------------------------------
// expand_rows_v{16,8,4,2}: out[n] = table[m] for every (m, j) with
// targets[m * fanout + j] == n; out rows n with sources[n] outside
// [0, num_table_rows) are written with zeros.
//   grid:   num_table_rows + ceil(num_out_rows / ZERO_ROWS_PER_BLOCK) blocks;
//           block b < num_table_rows copies table row b, later blocks zero-fill.
//   block:  any multiple of 32 threads; each thread moves UNROLL vectors per
//           step, loading all before storing.
//   inputs: table [num_table_rows, row_vecs] VEC, targets [num_table_rows,
//           fanout] int32, sources [num_out_rows] int32.
//   output: out [num_out_rows, row_vecs] VEC.
//   bounds: a target outside [0, num_out_rows) is skipped; a source outside
//           [0, num_table_rows) means "zero row". targets and sources are two
//           directions of one map, so every out row is written exactly once.
// ---------------------------------------------------------------------------
#define EXPAND_UNROLL 4
#define ZERO_ROWS_PER_BLOCK 8

template <typename Vec>
__device__ __forceinline__ void expand_rows(const Vec* __restrict__ table,
                                            const int* __restrict__ targets,
                                            const int* __restrict__ sources,
                                            Vec* __restrict__ out, int num_table_rows, int fanout,
                                            int num_out_rows, int row_vecs) {
  const i64 block = blockIdx.x;
  if (block < num_table_rows) {
    const Vec* src = table + block * row_vecs;
    const int* row_targets = targets + block * fanout;
    for (int base = threadIdx.x; base < row_vecs; base += blockDim.x * EXPAND_UNROLL) {
      Vec values[EXPAND_UNROLL];
#pragma unroll
      for (int u = 0; u < EXPAND_UNROLL; ++u) {
        const int v = base + u * blockDim.x;
        if (v < row_vecs) values[u] = src[v];
      }
      for (int j = 0; j < fanout; ++j) {
        const int n = __ldg(row_targets + j);
        if (n < 0 || n >= num_out_rows) continue;
        Vec* dst = out + (i64)n * row_vecs;
#pragma unroll
        for (int u = 0; u < EXPAND_UNROLL; ++u) {
          const int v = base + u * blockDim.x;
          if (v < row_vecs) dst[v] = values[u];
        }
      }
    }
    return;
  }
  const i64 first = (block - num_table_rows) * ZERO_ROWS_PER_BLOCK;
  for (int r = 0; r < ZERO_ROWS_PER_BLOCK; ++r) {
    const i64 n = first + r;
    if (n >= num_out_rows) return;
    const int m = __ldg(sources + n);
    if (m >= 0 && m < num_table_rows) continue;
    const Vec zero{};
    for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) out[n * row_vecs + v] = zero;
  }
}

#define DEFINE_EXPAND_ROWS(NAME, VEC)                                                         \
  extern "C" __global__ void NAME(const VEC* table, const int* targets, const int* sources,  \
                                  VEC* out, int num_table_rows, int fanout, int num_out_rows, \
                                  int row_vecs) {                                             \
    expand_rows<VEC>(table, targets, sources, out, num_table_rows, fanout, num_out_rows,      \
                     row_vecs);                                                               \
  }

DEFINE_EXPAND_ROWS(expand_rows_v16, uint4)
DEFINE_EXPAND_ROWS(expand_rows_v8, uint2)
DEFINE_EXPAND_ROWS(expand_rows_v4, unsigned int)
DEFINE_EXPAND_ROWS(expand_rows_v2, unsigned short)

// ---------------------------------------------------------------------------
// gather_sum_rows_{f32,bf16,f16}: out[m] = sum_j table[index[m * fanin + j]],
// accumulated in float32 in the order j = 0, 1, ... (an index outside
// [0, num_table_rows) adds +0.0), rounded to the table dtype once at the end.
// No atomics: the result is fixed bit for bit and equals the pure-JAX
// backend's `total = total + gather(...)` loop.
//   grid:   num_out_rows blocks; block: a multiple of 32 threads.
//   inputs: table [num_table_rows, row_elems], index [num_out_rows, fanin] int32.
//   output: out [num_out_rows, row_elems].
//   bounds: out-of-range indices are skipped (read as zero); 16-byte vector
//           access only when row_elems * sizeof(elem) is a multiple of 16.
// ---------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void gather_sum_rows(const typename T::Elem* __restrict__ table,
                                                const int* __restrict__ index,
                                                typename T::Elem* __restrict__ out,
                                                int num_table_rows, int fanin, int num_out_rows,
                                                int row_elems) {
  typedef typename T::Elem Elem;
  const i64 m = blockIdx.x;
  if (m >= num_out_rows) return;
  const int* row_index = index + m * fanin;
  Elem* dst = out + m * row_elems;
  constexpr int kPerVec = 16 / sizeof(Elem);
  if (row_elems % kPerVec == 0) {
    const int row_vecs = row_elems / kPerVec;
    for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) {
      float acc[kPerVec];
#pragma unroll
      for (int i = 0; i < kPerVec; ++i) acc[i] = 0.0f;
#pragma unroll 4
      for (int j = 0; j < fanin; ++j) {
        const int r = __ldg(row_index + j);
        Pack16<T> pack;
        pack.raw = uint4{0u, 0u, 0u, 0u};
        if (r >= 0 && r < num_table_rows)
          pack.raw = reinterpret_cast<const uint4*>(table + (i64)r * row_elems)[v];
#pragma unroll
        for (int i = 0; i < kPerVec; ++i) acc[i] += T::load(pack.elems[i]);
      }
      Pack16<T> result;
#pragma unroll
      for (int i = 0; i < kPerVec; ++i) result.elems[i] = T::store(acc[i]);
      reinterpret_cast<uint4*>(dst)[v] = result.raw;
    }
    return;
  }
  for (int e = threadIdx.x; e < row_elems; e += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < fanin; ++j) {
      const int r = __ldg(row_index + j);
      acc += (r >= 0 && r < num_table_rows) ? T::load(table[(i64)r * row_elems + e]) : 0.0f;
    }
    dst[e] = T::store(acc);
  }
}

#define DEFINE_GATHER_SUM_ROWS(NAME, TYPE)                                                    \
  extern "C" __global__ void NAME(const TYPE::Elem* table, const int* index, TYPE::Elem* out,  \
                                  int num_table_rows, int fanin, int num_out_rows,             \
                                  int row_elems) {                                             \
    gather_sum_rows<TYPE>(table, index, out, num_table_rows, fanin, num_out_rows, row_elems);  \
  }

DEFINE_GATHER_SUM_ROWS(gather_sum_rows_f32, F32)
DEFINE_GATHER_SUM_ROWS(gather_sum_rows_bf16, BF16)
DEFINE_GATHER_SUM_ROWS(gather_sum_rows_f16, F16)
