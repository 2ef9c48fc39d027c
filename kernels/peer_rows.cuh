// ===========================================================================
// Fused row paths of dispatch and combine (the peer branches of
// rows_to_slabs / slabs_to_rows in moe_ep/transport/row_paths.py). Same
// channel and protocol as peer_send / peer_recv, a slot holding the [S, H]
// rows one rank sends another, but rows move straight between XLA's buffers
// and the slots, with no [R, S, H] buffer on either side, and each exchange is
// one launch whose grid has two kinds of blocks:
//   sender blocks   [0, send_blocks): fill the other ranks' slots chunk by
//                   chunk (chunk q = slot rows [q * Q, q * Q + Q) for one
//                   destination), raising flags[p][rank][q] on the
//                   destination after each chunk;
//   receiver blocks [send_blocks, grid): everything that stays on this GPU
//                   (first the work that waits for nobody), and the rows the
//                   other ranks send, each chunk as soon as its flag is up.
// So the NVLink transfer overlaps the local memory traffic instead of
// preceding it. Sender blocks come first in the grid and never wait for a
// peer's progress in this exchange (only for the acknowledgement of step s - 2),
// so a receiver never waits on a block that cannot be scheduled.
//   dispatch: tokens --senders--> the other ranks' slots; receivers: zero the
//             padding rows, copy this rank's own rows straight into its slabs,
//             then expand each arriving chunk from the slots into the slabs.
//   combine:  senders: per row another rank sent here, the fixed-order sum of
//             its members (as gather_sum_rows) into that rank's slot;
//             receivers: per token the fixed-order sum over ranks of the
//             returned rows (its own rank's member sum computed in place), as
//             gather_sum_rows, waiting per chunk.
// One warp moves one unit: a row, or a segment of segment_vecs 16-byte vectors
// of a row when rows are few (decode), so that they still spread over the
// warps (rows are a multiple of 16 bytes). ep_size <= 32 and top_k <= 32, so
// lane d holds rank d's entry of a token and lane k member k's slab row. The
// maps (RoutingHandle in moe_ep/transport/layout.py):
//   send_token [R * S] int32: token in slot s of the chunk to rank d, or -1.
//   send_slot [T, R] int32: the slot s of token t's row to rank d, or -1.
//   recv_pos [R * S, K] int32: slab row l * C + c of member k of the row rank
//     src put in slot s (row src * S + s), or -1.
//   slab_row [L * C] int32: src * S + s feeding slab row n, or -1 (zero row).
// Bounds: every map entry is checked against its range (a token against
// [0, T), a slot against [0, S), a slab row against
// [0, L * C)); outside it means "no row". Launch sizes are checked on entry: a
// kernel that returns there moves nothing, and the peers' bounded waits then
// fail by name.
// ===========================================================================

#ifndef MOE_EP_PEER_ROWS_CUH
#define MOE_EP_PEER_ROWS_CUH

#include "peer.cuh"

#define ROW_COPY_UNROLL 4  // 16-byte vectors in flight per lane in the copies
#define ROW_SUM_UNROLL 2   // 16-byte vectors per lane per step of the sums
#define ROW_SUM_BATCH 4    // member rows loaded before their in-order adds
#define ROW_MAX_LANES 32   // ep_size and top_k limit: one lane per entry

__device__ __forceinline__ int lane_index() { return (int)(threadIdx.x & 31u); }

__device__ __forceinline__ bool row_args_ok(int rank, int ep_size, int send_capacity, int top_k,
                                            int num_slab_rows, int row_vecs, int segment_vecs) {
  return ep_size >= 2 && ep_size <= ROW_MAX_LANES && rank >= 0 && rank < ep_size &&
         send_capacity >= 1 && top_k >= 1 && top_k <= ROW_MAX_LANES && num_slab_rows >= 0 &&
         row_vecs >= 1 && segment_vecs >= 1 && (blockDim.x & 31u) == 0u;
}

// Unit `unit` of rows split into `segments` segments of segment_vecs units
// (16-byte vectors; the FP8 dispatch's own rows and senders: quantize steps):
// its row and its units [begin, end).
struct RowUnit {
  i64 row;
  int begin;
  int end;
};

__device__ __forceinline__ RowUnit row_unit(i64 unit, int segments, int segment_vecs,
                                            int row_vecs) {
  RowUnit u;
  u.row = unit / segments;
  u.begin = (int)(unit % segments) * segment_vecs;
  u.end = min(u.begin + segment_vecs, row_vecs);
  return u;
}

// Lane d < ep_size: the slot s of token `token`'s row to rank d, else -1.
__device__ __forceinline__ int sent_slot(const int* __restrict__ send_slot, i64 token,
                                         int ep_size, int send_capacity) {
  const int lane = lane_index();
  if (lane >= ep_size) return -1;
  const int slot = __ldg(send_slot + token * ep_size + lane);
  return (slot >= 0 && slot < send_capacity) ? slot : -1;
}

// Lane k < top_k: the slab row of member k of received row `row`, else -1.
// A map entry: through the read-only path, unless (kWritten) this launch
// wrote the map itself (peer_dispatch_layout), which only L2 sees.
template <bool kWritten>
__device__ __forceinline__ int map_entry(const int* __restrict__ map, i64 i) {
  if constexpr (kWritten) return __ldcg(map + i);
  else return __ldg(map + i);
}

template <bool kWritten = false>
__device__ __forceinline__ int member_row(const int* __restrict__ recv_pos, i64 row, int top_k,
                                          int num_slab_rows) {
  const int lane = lane_index();
  if (lane >= top_k) return -1;
  const int n = map_entry<kWritten>(recv_pos, row * top_k + lane);
  return (n >= 0 && n < num_slab_rows) ? n : -1;
}

// Whether the row in slot `row` came from its source at all: some member
// routed here (kept, or dropped for capacity: -2), warp-wide. Combine sends
// back only those rows (P2 at EP=8, E=64: a third of each chunk is empty).
__device__ __forceinline__ bool slot_held_row(const int* __restrict__ recv_pos, i64 row,
                                              int top_k) {
  const int lane = lane_index();
  const bool dropped =
      lane < top_k && __ldg(recv_pos + row * top_k + lane) == MOE_EP_DROPPED_MEMBER;
  return __ballot_sync(MOE_EP_FULL_MASK, dropped) != 0u;
}

__device__ __forceinline__ u64 slot_address(u64 base, i64 data_offset, int parity, int ep_size,
                                            int slot, i64 slot_bytes) {
  return base + (u64)data_offset + (u64)(parity * (ep_size - 1) + slot) * (u64)slot_bytes;
}

// Vectors base + u * 32 + lane (below `end`) of one row, u < U: a warp-wide step.
template <int U, bool kFromPeerBuffer>
__device__ __forceinline__ void load_step(const uint4* __restrict__ row, int base, int end,
                                          uint4 (&values)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int v = base + u * 32 + lane_index();
    values[u] = make_uint4(0u, 0u, 0u, 0u);
    if (v < end) values[u] = kFromPeerBuffer ? __ldcg(row + v) : row[v];
  }
}

template <int U>
__device__ __forceinline__ void store_step(const uint4 (&values)[U], uint4* __restrict__ row,
                                           int base, int end) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int v = base + u * 32 + lane_index();
    if (v < end) row[v] = values[u];
  }
}

// The sums accumulate in float32 and round once at the end, with
// common.cuh's F32 / BF16 / F16 (so the results are rows.cu's gather_sum_rows').
template <typename T>
__device__ __forceinline__ void add_vector(uint4 raw, float (&acc)[16 / sizeof(typename T::Elem)]) {
  Pack16<T> pack;
  pack.raw = raw;
#pragma unroll
  for (int e = 0; e < 16 / (int)sizeof(typename T::Elem); ++e) acc[e] += T::load(pack.elems[e]);
}

// acc += the slab rows of the members in `members` (lane k holds member k's
// row), one warp-wide step, in the order k = 0, 1, ...: gather_sum_rows' sum
// over one row of recv_pos. An absent member adds +0.0 there and nothing
// here, the same bits: the sum starts at +0.0 and a float32 sum that starts
// at +0.0 is never -0.0 (round to nearest), so adding +0.0 leaves it as it is.
template <typename T, int U>
__device__ __forceinline__ void add_members(const uint4* __restrict__ table, int row_vecs,
                                            int member, u32 members, int base, int end,
                                            float (&acc)[U][16 / sizeof(typename T::Elem)]) {
  while (members != 0u) {  // warp-uniform
    uint4 values[ROW_SUM_BATCH][U];
    int taken = 0;
#pragma unroll
    for (int j = 0; j < ROW_SUM_BATCH; ++j) {
      if (members != 0u) {
        const int k = __ffs(members) - 1;
        members &= members - 1u;
        const int n = __shfl_sync(MOE_EP_FULL_MASK, member, k);
        load_step<U, false>(table + (i64)n * row_vecs, base, end, values[j]);
        taken = j + 1;
      }
    }
#pragma unroll
    for (int j = 0; j < ROW_SUM_BATCH; ++j) {
      if (j < taken) {
#pragma unroll
        for (int u = 0; u < U; ++u) add_vector<T>(values[j][u], acc[u]);
      }
    }
  }
}

// Float32 accumulators set to +0.0 (the start of every fixed-order sum).
template <int U, int N>
__device__ __forceinline__ void zero_sums(float (&acc)[U][N]) {
#pragma unroll
  for (int i = 0; i < U; ++i)
#pragma unroll
    for (int e = 0; e < N; ++e) acc[i][e] = 0.0f;
}

template <typename T, int U>
__device__ __forceinline__ void store_sums(const float (&acc)[U][16 / sizeof(typename T::Elem)],
                                           uint4* __restrict__ row, int base, int end) {
  uint4 values[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    Pack16<T> pack;
#pragma unroll
    for (int e = 0; e < 16 / (int)sizeof(typename T::Elem); ++e)
      pack.elems[e] = T::store(acc[u][e]);
    values[u] = pack.raw;
  }
  store_step<U>(values, row, base, end);
}


// One launch's view of its channel: this device's step and parity, and what
// a timed-out wait records.
struct Exchange {
  u64 own;
  const u64* peers;
  int rank;
  int ep_size;
  u64 step;
  int parity;
  i64 slot_bytes;
  i64 data_offset;
  u32* failed;
  PeerFailure* record;
  u64 timeout_ns;
  int site;
};

__device__ __forceinline__ Exchange open_exchange(const u64* peers, int rank, int ep_size,
                                                  i64 slot_bytes, i64 data_offset, u32* failed,
                                                  PeerFailure* record, u64 timeout_ns, int site) {
  Exchange ex;
  ex.own = peers[rank];
  ex.peers = peers;
  ex.rank = rank;
  ex.ep_size = ep_size;
  ex.step = *(volatile u64*)step_of(ex.own, ep_size) + 1;
  ex.parity = (int)(ex.step & 1ull);
  ex.slot_bytes = slot_bytes;
  ex.data_offset = data_offset;
  ex.failed = failed;
  ex.record = record;
  ex.timeout_ns = timeout_ns;
  ex.site = site;
  return ex;
}

// The chunking of one fused exchange: S slot rows per destination in chunks
// of chunk_rows.
struct Chunks {
  int send_capacity;
  int chunk_rows;
  int num_chunks;
  int send_blocks;
};

__device__ __forceinline__ bool chunks_ok(const Chunks& c) {
  return c.chunk_rows >= 1 && c.num_chunks >= 1 && c.num_chunks <= PEER_MAX_CHUNKS &&
         (i64)c.num_chunks * c.chunk_rows >= c.send_capacity &&
         (i64)(c.num_chunks - 1) * c.chunk_rows < c.send_capacity && c.send_blocks >= 1 &&
         c.send_blocks < (int)gridDim.x;
}

// The slot `ex`'s rank fills on rank `dest` (dest's memory), or the slot rank
// `src` fills here (this device's memory): same formula, seen from each side.
__device__ __forceinline__ uint4* slot_on(const Exchange& ex, u64 base, int writer, int owner) {
  return (uint4*)slot_address(base, ex.data_offset, ex.parity, ex.ep_size, slot_of(writer, owner),
                              ex.slot_bytes);
}

// Sender blocks: chunks (q, dest) in q-major order, block b taking chunks b,
// b + send_blocks, ...; each warp of the block produces units of the chunk's
// rows with `fill(dest, s, unit, slot_row)` (a row: row_units units, in
// `segments` units of segment_units; slot_row: row s of this rank's slot on
// dest, rows of slot_row_vecs vectors), then the block raises
// flags[p][rank][q] on dest. Waits first for every destination's
// acknowledgement of step s - 2 (its slots are free).
template <typename Fill>
__device__ __forceinline__ void send_chunks(const Exchange& ex, const Chunks& c, int segments,
                                            int segment_units, int row_units, int slot_row_vecs,
                                            Fill fill) {
  if (threadIdx.x == 0 && ex.step > 2) {
    for (int dest = 0; dest < ex.ep_size; ++dest)
      if (dest != ex.rank)
        thread_wait(acks_of(ex.own, ex.ep_size) + ex.parity * ex.ep_size + dest, ex.step - 2,
                    ex.failed, ex.record, ex.timeout_ns, PEER_WAIT_ACK, dest, ex.site, ex.rank,
                    ex.step - 2);
  }
  __syncthreads();
  const int others = ex.ep_size - 1;
  const int warp = (int)(threadIdx.x >> 5), warps = (int)(blockDim.x >> 5);
  for (i64 chunk = blockIdx.x; chunk < (i64)c.num_chunks * others; chunk += c.send_blocks) {
    const int q = (int)(chunk / others), nth = (int)(chunk % others);
    const int dest = nth < ex.rank ? nth : nth + 1;
    uint4* slot = slot_on(ex, ex.peers[dest], ex.rank, dest);
    const int first = q * c.chunk_rows;
    const int rows = min(c.chunk_rows, c.send_capacity - first);
    for (int unit = warp; unit < rows * segments; unit += warps) {
      const RowUnit u = row_unit(unit, segments, segment_units, row_units);
      const i64 s = first + u.row;
      fill(dest, s, u, slot + s * slot_row_vecs);
    }
    // Release: the barrier orders every thread's stores of the chunk before
    // thread 0's system fence, which orders them before the flag (the
    // cooperative-groups grid barrier's pattern; one fence per chunk, not
    // one per thread).
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      atomicExch(flag_of(ex.peers[dest], ex.ep_size, ex.parity, ex.rank, q), ex.step);
    }
  }
}

// Lane 0 waits until flags[p][src][q] >= s here, unless (src, q) is the chunk
// it last waited for (*seen); then the warp reads the chunk (ld.cg: the rows
// were stored by another GPU).
__device__ __forceinline__ void warp_wait_chunk(const Exchange& ex, int src, int q, int* seen) {
  const int key = src * PEER_MAX_CHUNKS + q;
  if (lane_index() == 0 && key != *seen) {
    thread_wait(flag_of(ex.own, ex.ep_size, ex.parity, src, q), ex.step, ex.failed, ex.record,
                ex.timeout_ns, PEER_WAIT_FLAG, src, ex.site, ex.rank, ex.step);
    *seen = key;
  }
  __syncwarp();
}

// Thread 0 of a launch's last block (last_block_of_launch): acknowledges
// step `step` to every other rank (what it stored on the channel at `own`
// is read) and advances that channel's step.
__device__ __forceinline__ void acknowledge_step(const u64* peers, u64 own, int rank,
                                                 int ep_size, int parity, u64 step) {
  __threadfence_system();
  for (int src = 0; src < ep_size; ++src)
    if (src != rank) atomicExch(acks_of(peers[src], ep_size) + parity * ep_size + rank, step);
  *(volatile u64*)step_of(own, ep_size) = step;
}

// The end of every block: once all blocks of the grid are done, acknowledges
// step s to every other rank (its rows here are read) and advances the step.
__device__ __forceinline__ void finish_exchange(const Exchange& ex) {
  if (last_block_of_launch(ex.own, ex.ep_size))
    acknowledge_step(ex.peers, ex.own, ex.rank, ex.ep_size, ex.parity, ex.step);
}


// Receiver warps: index and count among the receiver blocks.
__device__ __forceinline__ i64 receiver_warp(int send_blocks) {
  return ((i64)(blockIdx.x - send_blocks) * blockDim.x + threadIdx.x) >> 5;
}
__device__ __forceinline__ i64 receiver_warps(int send_blocks) {
  return ((i64)(gridDim.x - send_blocks) * blockDim.x) >> 5;
}

// Copies one unit of `row` into `out` (one wire row; none if null) and into
// the slab rows of the members in `members` (lane k holds member k's slab row).
template <bool kFromPeerBuffer>
__device__ __forceinline__ void copy_to_members(const uint4* __restrict__ row,
                                                uint4* __restrict__ out,
                                                uint4* __restrict__ slabs, int row_vecs,
                                                int member, u32 members, const RowUnit& u) {
  for (int base = u.begin; base < u.end; base += 32 * ROW_COPY_UNROLL) {
    uint4 values[ROW_COPY_UNROLL];
    load_step<ROW_COPY_UNROLL, kFromPeerBuffer>(row, base, u.end, values);
    if (out != nullptr) store_step<ROW_COPY_UNROLL>(values, out, base, u.end);
    for (u32 m = members; m != 0u; m &= m - 1u) {
      const int k = __ffs(m) - 1;
      store_step<ROW_COPY_UNROLL>(
          values, slabs + (i64)__shfl_sync(MOE_EP_FULL_MASK, member, k) * row_vecs, base, u.end);
    }
  }
}

#endif  // MOE_EP_PEER_ROWS_CUH
