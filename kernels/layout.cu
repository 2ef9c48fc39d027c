// Routing layout of dispatch: integer work only, no float atomics.
//
// Both sides rank items stably by key with the same two launches over tiles
// of blockDim.x items (one item per thread):
//   *_count  per tile and key, how many items carry the key (warp ballots or
//            __match_any_sync, combined through shared memory);
//   *_rank   every block sums the earlier tiles' counts (its tile offset) and
//            all of them (the totals); per item: tile offset + earlier warps'
//            counts + earlier lanes' matches = its stable rank among items
//            with its key; then the blocks fill what no item owns (padding
//            past the totals, per-key summaries) grid-stride.
// Two launches rather than a scan launch between them: at decode sizes every
// launch is latency on the dispatch's critical path, and re-reading
// tiles * keys counts from L2 per block costs less than one. For the same
// reason, with few tiles (decode) the *_rank kernel's blocks count the tiles
// themselves (*_rank_own_count) and the *_count launch is left out.
// Items are tokens on the sender (keys: destination ranks; a token carries
// every rank one of its K experts lives on) and received members (src, slot,
// k) on the receiver (key: local expert), so ranks follow token order, which
// is the slab order the transport promises. The receiver's rank pass and the
// tile sums are in slab_layout.cuh (peer_layout.cuh fuses them with the exchange).
//
// Metadata layout (moe_ep/transport/meta.py): one int32 row of
// meta_width = 2*S*K + L words per destination rank:
//   [0, S*K) local expert id of member k of slot s, or -1;
//   [S*K, 2*S*K) its weight as float32 bits; [2*S*K, +L) routes per expert.

#include "common.cuh"
#include "slab_layout.cuh"

__device__ __forceinline__ bool valid_expert(int expert, int num_experts) {
  return expert >= 0 && expert < num_experts;
}

// Rank dest owns experts [dest * L, (dest + 1) * L): a range test, not a
// division (integer division by a runtime value is ~25 instructions, and the
// routing kernels are instruction bound at decode sizes).
__device__ __forceinline__ bool routes_to(const int* ids, int top_k, int local_experts,
                                          int dest) {
  const int first = dest * local_experts, end = first + local_experts;
  for (int k = 0; k < top_k; ++k)
    if (ids[k] >= first && ids[k] < end) return true;
  return false;
}

// (i / width, i % width) for i = threadIdx.x, + blockDim.x, ...: one division
// up front, then carries.
struct RowCol {
  int row, col, row_step, col_step, width;
  __device__ __forceinline__ explicit RowCol(int width)
      : row(threadIdx.x / width), col(threadIdx.x % width), row_step(blockDim.x / width),
        col_step(blockDim.x % width), width(width) {}
  __device__ __forceinline__ void advance() {
    row += row_step;
    col += col_step;
    if (col >= width) {
      col -= width;
      ++row;
    }
  }
};

// Per warp and destination rank, how many of the warp's tokens route there
// (`ids`: the token's K ids, rank d owning [d * range, (d + 1) * range));
// warp_counts [warps, R]; ends with __syncthreads.
__device__ __forceinline__ void count_warp_dests(const int* ids, int top_k, int range,
                                                 bool active, int ep_size, int* warp_counts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int d = 0; d < ep_size; ++d) {
    const bool member = active && routes_to(ids, top_k, range, d);
    const u32 ballot = __ballot_sync(MOE_EP_FULL_MASK, member);
    if (lane == 0) warp_counts[warp * ep_size + d] = __popc(ballot);
  }
  __syncthreads();
}

// Tile `tile`'s members per destination rank into dest_counts [R] (any
// memory) and routes per expert into expert_hist [E] (shared); warp_counts
// [warps, R] shared scratch.
__device__ __forceinline__ void count_tile(const int* __restrict__ topk_idx, int tile,
                                           int num_tokens, int top_k, int num_experts,
                                           int local_experts, int ep_size, int* warp_counts,
                                           int* expert_hist, int* dest_counts) {
  const int warps = blockDim.x / 32;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) expert_hist[e] = 0;
  __syncthreads();
  const i64 t = (i64)tile * blockDim.x + threadIdx.x;
  const bool active = t < num_tokens;
  const int* ids = topk_idx + (active ? t : 0) * top_k;
  if (active) {
    for (int k = 0; k < top_k; ++k) {
      const int e = ids[k];
      if (valid_expert(e, num_experts)) atomicAdd(&expert_hist[e], 1);  // int: exact
    }
  }
  count_warp_dests(ids, top_k, local_experts, active, ep_size, warp_counts);
  for (int d = threadIdx.x; d < ep_size; d += blockDim.x)
    dest_counts[d] = tile_total(warp_counts, warps, ep_size, d);
}

// ---------------------------------------------------------------------------
// route_count: per tile of tokens, members per destination rank and routes
// per expert.
//   grid: ceil(T / blockDim.x); block: 32 * warps threads;
//   dynamic shared memory: (warps * R + E) ints.
//   inputs: topk_idx [T, K] int32.
//   outputs: tile_dest_counts [tiles, R], tile_expert_counts [tiles, E].
//   bounds: ids outside [0, E) are not routed; tokens past T count nothing.
// ---------------------------------------------------------------------------
extern "C" __global__ void route_count(const int* __restrict__ topk_idx, int num_tokens,
                                       int top_k, int num_experts, int local_experts,
                                       int ep_size, int* __restrict__ tile_dest_counts,
                                       int* __restrict__ tile_expert_counts) {
  const int warps = blockDim.x / 32;
  int* warp_counts = shared;                    // [warps, R]
  int* expert_hist = shared + warps * ep_size;  // [E]
  count_tile(topk_idx, blockIdx.x, num_tokens, top_k, num_experts, local_experts, ep_size,
             warp_counts, expert_hist, tile_dest_counts + (i64)blockIdx.x * ep_size);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    tile_expert_counts[(i64)blockIdx.x * num_experts + e] = expert_hist[e];
}

// Routes a thread stages per batch: all of a batch's loads are issued before
// any is used, so a tile waits for one round trip to memory per batch, not
// one per route (a tile of T * K routes over blockDim threads: 8 each at P2's
// T=8192 with 128-thread tiles, 4 at decode).
#define MOE_EP_STAGE_BATCH 8

// Tile routes [first, first + items) of topk_idx/topk_weights into shared
// memory as (destination rank or -1, local expert, weight), each id divided
// once; no barrier.
__device__ __forceinline__ void stage_routes(const int* __restrict__ topk_idx,
                                             const float* __restrict__ topk_weights, i64 first,
                                             int items, int num_experts, int local_experts,
                                             int* tile_dest, int* tile_local,
                                             float* tile_weights) {
  for (int base = threadIdx.x; base < items; base += MOE_EP_STAGE_BATCH * blockDim.x) {
    int ids[MOE_EP_STAGE_BATCH];
    float weights[MOE_EP_STAGE_BATCH];
#pragma unroll
    for (int j = 0; j < MOE_EP_STAGE_BATCH; ++j) {
      const int i = base + j * blockDim.x;
      ids[j] = i < items ? __ldg(topk_idx + first + i) : -1;
      weights[j] = i < items ? __ldg(topk_weights + first + i) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < MOE_EP_STAGE_BATCH; ++j) {
      const int i = base + j * blockDim.x;
      if (i >= items) break;
      const int e = ids[j];
      const int d = valid_expert(e, num_experts) ? e / local_experts : -1;
      tile_dest[i] = d;
      tile_local[i] = e - d * local_experts;
      tile_weights[i] = weights[j];
    }
  }
}

// ---------------------------------------------------------------------------
// route_rank: each token's slot in its chunk to every rank it routes to, the
// route slots and metadata words of the tile, and (all blocks, grid-stride)
// the empty slots past each chunk's fill and the demand words.
//   grid: max(tiles, ceil(R * S / blockDim.x)), tiles as route_count (blocks
//   past the tiles only pad); block: as route_count;
//   shared memory: (warps + 3) * R + blockDim.x * (R + 1 + 3 * K) ints, and
//   R + E more in route_rank_own_count.
//   inputs: topk_idx [T, K], topk_weights [T, K] float32, route_count's
//   tile_dest_counts [tiles, R] and tile_expert_counts [tiles, E]; or, in
//   route_rank_own_count (one tile), no route_count launch: every block
//   counts the tile itself from its staged routes (at decode sizes a launch
//   costs more than that).
//   outputs: send_slot [T, R] (-1: no route or beyond S), send_token [R, S]
//   (-1 past the fill), route_slot [T, K], meta [R, meta_width].
//   bounds: a slot >= S is dropped on the wire (written as -1).
// The tile's routes are staged in shared memory (stage_routes) first.
// A tile's kept slots to rank d are one run [tile_offset[d], +kept), so the
// tile writes its [T, K] and metadata words as contiguous runs, consecutive
// threads on consecutive words (a thread per token would stride K words).
// ---------------------------------------------------------------------------
template <bool kCounted>
__device__ __forceinline__ void route_rank_body(
           const int* __restrict__ topk_idx, const float* __restrict__ topk_weights,
           int num_tokens, int top_k, int num_experts, int local_experts, int ep_size,
           int send_capacity, int num_tiles, const int* __restrict__ tile_dest_counts,
           const int* __restrict__ tile_expert_counts, int* __restrict__ send_slot,
           int* __restrict__ send_token, int* __restrict__ route_slot, int* __restrict__ meta,
           int meta_width, int demand_offset) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int* warp_counts = shared;                            // [warps, R]
  int* tile_offset = warp_counts + warps * ep_size;     // [R]
  int* dest_total = tile_offset + ep_size;              // [R]
  int* tile_count = dest_total + ep_size;               // [R]
  int* token_slot = tile_count + ep_size;               // [blockDim, R]: kept slot or -1
  int* slot_token = token_slot + blockDim.x * ep_size;  // [blockDim]: token of a kept slot
  int* tile_dest = slot_token + blockDim.x;              // [blockDim, K]: rank, or -1
  int* tile_local = tile_dest + blockDim.x * top_k;      // [blockDim, K]: local expert
  float* tile_weights = (float*)(tile_local + blockDim.x * top_k);  // [blockDim, K]
  const int* dest_counts = tile_dest_counts;
  const int* expert_counts = tile_expert_counts;
  // Without route_count there is one tile, which every block stages.
  const i64 tile_first = kCounted ? (i64)blockIdx.x * blockDim.x : 0;
  const bool stages = !kCounted || (int)blockIdx.x < num_tiles;
  const int tile_tokens = stages ? (int)min((i64)blockDim.x, num_tokens - tile_first) : 0;
  if (stages)
    stage_routes(topk_idx, topk_weights, tile_first * top_k, tile_tokens * top_k, num_experts,
                 local_experts, tile_dest, tile_local, tile_weights);
  if (!kCounted) {  // one tile, no route_count launch: every block counts it here
    int* own_dest_counts = (int*)(tile_weights + blockDim.x * top_k);  // [R]
    int* own_expert_counts = own_dest_counts + ep_size;               // [E]
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) own_expert_counts[e] = 0;
    __syncthreads();  // the staged routes and the zeroed counts
    for (int i = threadIdx.x; i < tile_tokens * top_k; i += blockDim.x) {
      const int d = tile_dest[i];
      if (d >= 0) atomicAdd(&own_expert_counts[d * local_experts + tile_local[i]], 1);  // exact
    }
    const bool active = (int)threadIdx.x < tile_tokens;
    count_warp_dests(tile_dest + (active ? threadIdx.x : 0) * top_k, top_k, 1, active, ep_size,
                     warp_counts);
    for (int d = threadIdx.x; d < ep_size; d += blockDim.x)
      own_dest_counts[d] = tile_total(warp_counts, warps, ep_size, d);
    dest_counts = own_dest_counts;  // sum_tiles' first barrier orders these
    expert_counts = own_expert_counts;
  }
  sum_tiles(dest_counts, num_tiles, ep_size, min((int)blockIdx.x, num_tiles), tile_offset,
            dest_total);
  const i64 members = (i64)send_capacity * top_k;
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (blockIdx.x < num_tiles) {  // whole block: the ballots need every lane
    const bool active = t < num_tokens;
    const int* dests = tile_dest + (active ? threadIdx.x : 0) * top_k;  // ranks: 1-wide ranges
    // sum_tiles' barriers ordered the staged routes; without route_count the
    // warp counts are the ones the block counted the tile with.
    if (kCounted) count_warp_dests(dests, top_k, 1, active, ep_size, warp_counts);
    for (int d = threadIdx.x; d < ep_size; d += blockDim.x)
      tile_count[d] = tile_total(warp_counts, warps, ep_size, d);
    for (int d = 0; d < ep_size; ++d) {
      const bool member = active && routes_to(dests, top_k, 1, d);
      const u32 ballot = __ballot_sync(MOE_EP_FULL_MASK, member);
      int slot = tile_offset[d] + __popc(ballot & lanemask_lt());
      for (int w = 0; w < warp; ++w) slot += warp_counts[w * ep_size + d];
      const bool kept = member && slot < send_capacity;
      token_slot[threadIdx.x * ep_size + d] = kept ? slot : -1;
      if (!active) continue;
      send_slot[t * ep_size + d] = kept ? slot : -1;
      if (kept) send_token[(i64)d * send_capacity + slot] = (int)t;
    }
    __syncthreads();
    RowCol token(top_k);  // (tile token, k) of route i
    for (int i = threadIdx.x; i < tile_tokens * top_k; i += blockDim.x, token.advance()) {
      const int d = tile_dest[i];
      const int slot = d >= 0 ? token_slot[token.row * ep_size + d] : -1;
      route_slot[tile_first * top_k + i] = slot >= 0 ? d * send_capacity + slot : -1;
    }
    for (int d = 0; d < ep_size; ++d) {
      const int first = tile_offset[d];
      const int kept = max(0, min(send_capacity, first + tile_count[d]) - first);
      const int slot = token_slot[threadIdx.x * ep_size + d];
      if (slot >= 0) slot_token[slot - first] = threadIdx.x;
      __syncthreads();
      int* ids_out = meta + (i64)d * meta_width + (i64)first * top_k;
      RowCol member(top_k);  // (slot - first, k) of word i
      for (int i = threadIdx.x; i < kept * top_k; i += blockDim.x, member.advance()) {
        const int route = slot_token[member.row] * top_k + member.col;
        const bool on_rank = tile_dest[route] == d;
        ids_out[i] = on_rank ? tile_local[route] : -1;
        ids_out[members + i] = on_rank ? __float_as_int(tile_weights[route]) : 0;
      }
      __syncthreads();  // slot_token is refilled for the next rank
    }
  }
  // The slots past each chunk's fill, and their metadata words (coalesced).
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (int d = 0; d < ep_size; ++d) {
    const int filled = min(dest_total[d], send_capacity);
    for (i64 s = filled + t; s < send_capacity; s += stride)
      send_token[(i64)d * send_capacity + s] = -1;
    int* row = meta + (i64)d * meta_width;
    for (i64 word = (i64)filled * top_k + t; word < members; word += stride) {
      row[word] = -1;
      row[members + word] = 0;
    }
  }
  // Demand words: a group of `width` lanes per expert splits the tiles, then a
  // shuffle sum. width: a power of two, at most 32 and the tiles, and no wider
  // than lets the grid cover every expert in one pass: with few tiles and many
  // experts (decode) a lane per expert, not several passes of lane groups.
  int width = 1;
  while (width < 32 && width < num_tiles && (i64)num_experts * (2 * width) <= stride) width *= 2;
  const int groups = 32 / width, group = lane / width, part = lane % width;
  const i64 experts_per_pass = stride / 32 * groups;
  for (i64 base = t / 32 * groups; base < num_experts; base += experts_per_pass) {
    const i64 e = base + group;  // the loop is warp-uniform: every lane shuffles
    int routes = 0;
    if (e < num_experts)
      for (int tile = part; tile < num_tiles; tile += width)
        routes += expert_counts[(i64)tile * num_experts + e];
    for (int offset = width / 2; offset > 0; offset >>= 1)
      routes += __shfl_xor_sync(MOE_EP_FULL_MASK, routes, offset);
    if (part == 0 && e < num_experts) {
      const int expert = (int)e;
      meta[(i64)(expert / local_experts) * meta_width + demand_offset + expert % local_experts] =
          routes;
    }
  }
}

// ---------------------------------------------------------------------------
// slab_count: members per (tile, local expert).
//   grid: ceil(N / blockDim.x); block: 32 * warps; shared: warps * L ints.
//   output: tile_counts [tiles, L].
// ---------------------------------------------------------------------------
extern "C" __global__ void slab_count(const int* __restrict__ meta, int ep_size,
                                      int send_capacity, int top_k, int local_experts,
                                      int meta_width, int* __restrict__ tile_counts) {
  count_slab_tile(MetaRows{meta, meta_width}, blockIdx.x, ep_size, send_capacity, top_k,
                  local_experts, shared, tile_counts + (i64)blockIdx.x * local_experts);
}

#define ROUTE_RANK_ARGS                                                                         \
  const int* __restrict__ topk_idx, const float* __restrict__ topk_weights, int num_tokens,      \
      int top_k, int num_experts, int local_experts, int ep_size, int send_capacity,             \
      int num_tiles, const int* __restrict__ tile_dest_counts,                                   \
      const int* __restrict__ tile_expert_counts, int* __restrict__ send_slot,                   \
      int* __restrict__ send_token, int* __restrict__ route_slot, int* __restrict__ meta,        \
      int meta_width, int demand_offset
#define ROUTE_RANK_PASS                                                                         \
  topk_idx, topk_weights, num_tokens, top_k, num_experts, local_experts, ep_size, send_capacity, \
      num_tiles, tile_dest_counts, tile_expert_counts, send_slot, send_token, route_slot, meta,  \
      meta_width, demand_offset
// route_rank after route_count; route_rank_own_count: one tile, counted here.
extern "C" __global__ void __launch_bounds__(1024) route_rank(ROUTE_RANK_ARGS) {
  route_rank_body<true>(ROUTE_RANK_PASS);
}
extern "C" __global__ void __launch_bounds__(1024) route_rank_own_count(ROUTE_RANK_ARGS) {
  route_rank_body<false>(ROUTE_RANK_PASS);
}

#define SLAB_RANK_ARGS                                                                          \
  const int* __restrict__ meta, int ep_size, int send_capacity, int top_k, int local_experts,    \
      int expert_capacity, int meta_width, int demand_offset, int num_tiles,                     \
      const int* __restrict__ tile_counts, int* __restrict__ recv_pos,                           \
      int* __restrict__ slab_row, float* __restrict__ slab_weights, int* __restrict__ counts,    \
      int* __restrict__ demand
#define SLAB_RANK_PASS                                                                          \
  MetaRows{meta, meta_width}, ep_size, send_capacity, top_k, local_experts, expert_capacity,     \
      demand_offset, num_tiles, tile_counts, recv_pos, slab_row, slab_weights, counts, demand,   \
      (int)blockIdx.x, (int)gridDim.x
// slab_rank after slab_count; slab_rank_own_count: few tiles, counted here
// (slab_rank_body in slab_layout.cuh says what they compute).
extern "C" __global__ void __launch_bounds__(1024) slab_rank(SLAB_RANK_ARGS) {
  slab_rank_body<true>(SLAB_RANK_PASS);
}
extern "C" __global__ void __launch_bounds__(1024) slab_rank_own_count(SLAB_RANK_ARGS) {
  slab_rank_body<false>(SLAB_RANK_PASS);
}
