// Tile sums and the receiver's slab layout, shared by layout.cu (the slab_*
// kernels) and peer_layout.cuh (the metadata exchange fused with the layout).

#ifndef MOE_EP_SLAB_LAYOUT_CUH
#define MOE_EP_SLAB_LAYOUT_CUH

#include "common.cuh"

// Every kernel's dynamic shared memory (one declaration: the kernels' bodies
// include templates, where a local extern declaration would conflict).
extern __shared__ int shared[];

// The tile's items with key d: the warps' counts [warps, keys] summed.
__device__ __forceinline__ int tile_total(const int* warp_counts, int warps, int keys, int d) {
  int total = 0;
  for (int w = 0; w < warps; ++w) total += warp_counts[w * keys + d];
  return total;
}

// ---------------------------------------------------------------------------
// Per key, the sum of tile_counts[tile, key] over tiles < before (prefix) and
// over all tiles (total), into shared memory; ends with __syncthreads. Every
// block of a rank kernel sums the count kernel's tiles itself, so no scan
// launch sits between count and rank (integer sums: exact in any order).
// ---------------------------------------------------------------------------
__device__ void sum_tiles(const int* __restrict__ tile_counts, int num_tiles, int keys,
                          int before, int* prefix, int* total) {
  for (int key = threadIdx.x; key < keys; key += blockDim.x) prefix[key] = total[key] = 0;
  __syncthreads();
  const int groups = max(1, (int)blockDim.x / keys);  // threads summing one key
  for (int i = threadIdx.x; i < groups * keys; i += blockDim.x) {
    const int key = i % keys, group = i / keys;
    int below = 0, all = 0;
    for (int tile = group; tile < num_tiles; tile += groups) {
      const int count = tile_counts[(i64)tile * keys + key];
      all += count;
      if (tile < before) below += count;
    }
    if (all) atomicAdd(&total[key], all);
    if (below) atomicAdd(&prefix[key], below);
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------
// Receiver. Member i = (src * S + s) * K + k of N = R * S * K; its key is the
// local expert id in meta[src, s * K + k] (outside [0, L): not routed).
// Members and slab positions are int32 (the handle's own type; Python refuses
// N or L * C >= 2**31): 64-bit division is a long subroutine on the GPU.
// The receiver reads source src's metadata row (meta_width words) through
// `Meta::word(src, i)`: MetaRows, the rows of one [R, meta_width] buffer
// (the slab_* kernels, after the exchange), or the peer kernels' rows where they
// landed in the peer channel.
// ---------------------------------------------------------------------------
// Source src's row: S * K local expert ids, S * K weights (float32 bits),
// then the L demand counts (moe_ep/transport/meta.py).
__device__ __forceinline__ int meta_demand_offset(int send_capacity, int top_k) {
  return 2 * send_capacity * top_k;
}

__device__ __forceinline__ int meta_row_width(int send_capacity, int top_k, int local_experts) {
  return meta_demand_offset(send_capacity, top_k) + local_experts;
}

struct MetaRows {
  const int* __restrict__ meta;  // [R, width]
  int width;
  __device__ __forceinline__ int word(int src, int i) const { return meta[(i64)src * width + i]; }
};

template <typename Meta>
__device__ __forceinline__ int member_key(const Meta& meta, int member, int num_members,
                                          int send_capacity, int top_k, int local_experts) {
  if (member >= num_members) return -1;
  const int per_src = send_capacity * top_k;
  const int key = meta.word(member / per_src, member % per_src);
  return (key >= 0 && key < local_experts) ? key : -1;
}

// Per warp: lanes with the same key, and how many; leaders write warp counts.
__device__ __forceinline__ u32 count_warp_keys(int key, int* warp_counts, int local_experts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const u32 peers = __match_any_sync(MOE_EP_FULL_MASK, key);
  if (key >= 0 && lane == __ffs(peers) - 1)
    warp_counts[warp * local_experts + key] = __popc(peers);
  return peers;
}

// Tile `tile`'s members per local expert into tile_counts [L] (any memory);
// warp_counts [warps, L] shared scratch.
template <typename Meta>
__device__ __forceinline__ void count_slab_tile(const Meta& meta, int tile, int ep_size,
                                                int send_capacity, int top_k, int local_experts,
                                                int* warp_counts, int* tile_counts) {
  const int warps = blockDim.x / 32;
  for (int i = threadIdx.x; i < warps * local_experts; i += blockDim.x) warp_counts[i] = 0;
  __syncthreads();
  const int num_members = ep_size * send_capacity * top_k;
  const int member = tile * blockDim.x + threadIdx.x;
  count_warp_keys(member_key(meta, member, num_members, send_capacity, top_k, local_experts),
                  warp_counts, local_experts);
  __syncthreads();
  for (int l = threadIdx.x; l < local_experts; l += blockDim.x)
    tile_counts[l] = tile_total(warp_counts, warps, local_experts, l);
}

// ---------------------------------------------------------------------------
// slab_rank: each member's slab position (members ranked >= C are dropped),
// and (all blocks, grid-stride) the padding rows past each expert's count,
// the counts and the demand.
//   grid: max(tiles, ceil(L * C / blockDim.x)), tiles as slab_count (blocks
//   past the tiles only pad); block: as slab_count;
//   shared memory: (warps + 2) * L ints, and tiles * L more in
//   slab_rank_own_count.
//   inputs: meta [R, meta_width], slab_count's tile_counts [tiles, L]; or,
//   in slab_rank_own_count (few tiles), no slab_count launch: every block
//   counts the other tiles itself (at decode sizes that costs less than a
//   launch).
//   outputs: recv_pos [N] (l * C + c; -1 not routed here, -2 dropped for
//   capacity); slab_row [L, C] (-1 on padding)
//   and slab_weights [L, C] (0 on padding); counts [L] (kept, at most C);
//   demand [L] (the routes every source sent for it, before any drop).
// ---------------------------------------------------------------------------
// Block `block` of `blocks` (the grid, or a fused kernel's part of it).
template <bool kCounted, typename Meta>
__device__ __forceinline__ void slab_rank_body(
          const Meta& meta, int ep_size, int send_capacity, int top_k, int local_experts,
          int expert_capacity, int demand_offset, int num_tiles,
          const int* __restrict__ tile_counts, int* __restrict__ recv_pos,
          int* __restrict__ slab_row, float* __restrict__ slab_weights, int* __restrict__ counts,
          int* __restrict__ demand, int block, int blocks) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32;
  int* warp_counts = shared;                          // [warps, L]
  int* tile_offset = shared + warps * local_experts;  // [L]
  int* expert_total = tile_offset + local_experts;    // [L]
  const int num_members = ep_size * send_capacity * top_k;
  const int per_src = send_capacity * top_k;
  const int member = block * blockDim.x + threadIdx.x;
  const bool ranks_members = block < num_tiles;
  // The member's key and weight are loaded before sum_tiles, whose loads
  // then wait alongside them rather than after.
  const int key = ranks_members ? member_key(meta, member, num_members, send_capacity, top_k,
                                             local_experts)
                                : -1;
  const int weight_bits = (ranks_members && member < num_members)
      ? meta.word(member / per_src, per_src + member % per_src) : 0;
  // No slab_count launch: every block counts the other tiles here; its own
  // tile's counts come from its rank pass below (one tile: no extra pass).
  const int* counts_of_tiles = tile_counts;
  const int own_tile = !kCounted && ranks_members ? block : -1;
  if (!kCounted) {
    int* own_counts = expert_total + local_experts;  // [tiles, L]
    for (int tile = 0; tile < num_tiles; ++tile) {  // block-uniform
      if (tile == own_tile) {
        for (int l = threadIdx.x; l < local_experts; l += blockDim.x)
          own_counts[tile * local_experts + l] = 0;  // sum_tiles' first barrier orders these
        continue;
      }
      count_slab_tile(meta, tile, ep_size, send_capacity, top_k, local_experts, warp_counts,
                      own_counts + tile * local_experts);
      __syncthreads();  // warp_counts is reused
    }
    counts_of_tiles = own_counts;
  }
  for (int i = threadIdx.x; i < warps * local_experts; i += blockDim.x) warp_counts[i] = 0;
  sum_tiles(counts_of_tiles, num_tiles, local_experts, min(block, num_tiles),
            tile_offset, expert_total);  // its barriers also order the zeroing above
  if (ranks_members) {  // whole block: __match_any_sync needs every lane
    const u32 peers = count_warp_keys(key, warp_counts, local_experts);
    __syncthreads();
    if (member < num_members) {
      int pos = -1;
      if (key >= 0) {
        pos = tile_offset[key] + __popc(peers & lanemask_lt());
        for (int w = 0; w < warp; ++w) pos += warp_counts[w * local_experts + key];
        if (pos >= expert_capacity) pos = -1;
      }
      if (pos >= 0) {
        const int slab_index = key * expert_capacity + pos;
        recv_pos[member] = slab_index;
        slab_row[slab_index] = member / top_k;
        slab_weights[slab_index] = __int_as_float(weight_bits);
      } else {
        recv_pos[member] = key >= 0 ? MOE_EP_DROPPED_MEMBER : -1;
      }
    }
    if (own_tile >= 0)
      for (int l = threadIdx.x; l < local_experts; l += blockDim.x)
        expert_total[l] += tile_total(warp_counts, warps, local_experts, l);
  }
  if (!kCounted) __syncthreads();  // the totals are complete
  const int stride = blocks * blockDim.x;
  for (int i = member; i < local_experts * expert_capacity; i += stride) {
    const int l = i / expert_capacity;
    if (i - l * expert_capacity < expert_total[l]) continue;  // a member's row
    slab_row[i] = -1;
    slab_weights[i] = 0.0f;
  }
  for (int l = member; l < local_experts; l += stride) {
    int routes = 0;
    for (int src = 0; src < ep_size; ++src)
      routes += meta.word(src, demand_offset + l);
    counts[l] = min(expert_total[l], expert_capacity);
    demand[l] = routes;
  }
}

#endif  // MOE_EP_SLAB_LAYOUT_CUH
