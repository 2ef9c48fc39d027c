// Routing layout of dispatch: integer work only, no float atomics.
//
// Both sides rank items stably by key with the same three passes over tiles
// of blockDim.x items (one item per thread):
//   *_count  per tile and key, how many items carry the key (warp ballots or
//            __match_any_sync, combined through shared memory);
//   *_scan   one block: exclusive scan over tiles per key, totals;
//   *_rank   per item: tile offset + earlier warps' counts + earlier lanes'
//            matches = its stable rank among items with its key.
// Items are tokens on the sender (keys: destination ranks; a token carries
// every rank one of its K experts lives on) and received members (src, slot,
// k) on the receiver (key: local expert), so ranks follow token order, which
// is the slab order the transport promises.
//
// Metadata layout (moe_ep/transport/meta.py): one int32 row of
// meta_width = 2*S*K + L words per destination rank:
//   [0, S*K) local expert id of member k of slot s, or -1;
//   [S*K, 2*S*K) its weight as float32 bits; [2*S*K, +L) routes per expert.

__device__ __forceinline__ bool valid_expert(int expert, int num_experts) {
  return expert >= 0 && expert < num_experts;
}

__device__ __forceinline__ bool routes_to(const int* ids, int top_k, int num_experts,
                                          int local_experts, int dest) {
  for (int k = 0; k < top_k; ++k) {
    const int e = ids[k];
    if (valid_expert(e, num_experts) && e / local_experts == dest) return true;
  }
  return false;
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
  extern __shared__ int shared[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int* warp_counts = shared;                 // [warps, R]
  int* expert_hist = shared + warps * ep_size;  // [E]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) expert_hist[e] = 0;
  __syncthreads();
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const bool active = t < num_tokens;
  const int* ids = topk_idx + (active ? t : 0) * top_k;
  if (active) {
    for (int k = 0; k < top_k; ++k) {
      const int e = ids[k];
      if (valid_expert(e, num_experts)) atomicAdd(&expert_hist[e], 1);  // int: exact
    }
  }
  for (int d = 0; d < ep_size; ++d) {
    const bool member = active && routes_to(ids, top_k, num_experts, local_experts, d);
    const u32 ballot = __ballot_sync(MOE_EP_FULL_MASK, member);
    if (lane == 0) warp_counts[warp * ep_size + d] = __popc(ballot);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < ep_size; d += blockDim.x) {
    int total = 0;
    for (int w = 0; w < warps; ++w) total += warp_counts[w * ep_size + d];
    tile_dest_counts[(i64)blockIdx.x * ep_size + d] = total;
  }
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    tile_expert_counts[(i64)blockIdx.x * num_experts + e] = expert_hist[e];
}

// ---------------------------------------------------------------------------
// route_scan: exclusive scan of the per-tile destination counts, destination
// totals, and the demand words of the metadata.
//   grid: 1 block; any block size.
//   outputs: tile_dest_offsets [tiles, R], dest_totals [R], meta demand words.
// ---------------------------------------------------------------------------
extern "C" __global__ void route_scan(const int* __restrict__ tile_dest_counts,
                                      const int* __restrict__ tile_expert_counts, int num_tiles,
                                      int ep_size, int num_experts, int local_experts,
                                      int meta_width, int demand_offset,
                                      int* __restrict__ tile_dest_offsets,
                                      int* __restrict__ dest_totals, int* __restrict__ meta) {
  for (int d = threadIdx.x; d < ep_size; d += blockDim.x) {
    int running = 0;
    for (int tile = 0; tile < num_tiles; ++tile) {
      tile_dest_offsets[(i64)tile * ep_size + d] = running;
      running += tile_dest_counts[(i64)tile * ep_size + d];
    }
    dest_totals[d] = running;
  }
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int routes = 0;
    for (int tile = 0; tile < num_tiles; ++tile)
      routes += tile_expert_counts[(i64)tile * num_experts + e];
    meta[(i64)(e / local_experts) * meta_width + demand_offset + e % local_experts] = routes;
  }
}

// ---------------------------------------------------------------------------
// route_rank: each token's slot in its chunk to every rank it routes to.
//   grid/block/shared: as route_count, shared memory warps * R ints.
//   outputs: send_slot [T, R] (-1: no route or beyond S), send_token [R, S]
//   at kept slots (route_finish fills the rest), route_slot [T, K].
//   bounds: a slot >= S is dropped on the wire (written as -1).
// ---------------------------------------------------------------------------
extern "C" __global__ void route_rank(const int* __restrict__ topk_idx, int num_tokens, int top_k,
                                      int num_experts, int local_experts, int ep_size,
                                      int send_capacity,
                                      const int* __restrict__ tile_dest_offsets,
                                      int* __restrict__ send_slot, int* __restrict__ send_token,
                                      int* __restrict__ route_slot) {
  extern __shared__ int shared[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int* warp_counts = shared;  // [warps, R]
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const bool active = t < num_tokens;
  const int* ids = topk_idx + (active ? t : 0) * top_k;
  for (int d = 0; d < ep_size; ++d) {
    const bool member = active && routes_to(ids, top_k, num_experts, local_experts, d);
    const u32 ballot = __ballot_sync(MOE_EP_FULL_MASK, member);
    if (lane == 0) warp_counts[warp * ep_size + d] = __popc(ballot);
  }
  __syncthreads();
  for (int d = 0; d < ep_size; ++d) {
    const bool member = active && routes_to(ids, top_k, num_experts, local_experts, d);
    const u32 ballot = __ballot_sync(MOE_EP_FULL_MASK, member);
    int slot = tile_dest_offsets[(i64)blockIdx.x * ep_size + d] + __popc(ballot & lanemask_lt());
    for (int w = 0; w < warp; ++w) slot += warp_counts[w * ep_size + d];
    if (!active) continue;
    const bool kept = member && slot < send_capacity;
    send_slot[t * ep_size + d] = kept ? slot : -1;
    if (kept) send_token[(i64)d * send_capacity + slot] = (int)t;
    if (!member) continue;
    for (int k = 0; k < top_k; ++k) {
      const int e = ids[k];
      if (valid_expert(e, num_experts) && e / local_experts == d)
        route_slot[t * top_k + k] = kept ? d * send_capacity + slot : -1;
    }
  }
  if (!active) return;
  for (int k = 0; k < top_k; ++k)
    if (!valid_expert(ids[k], num_experts)) route_slot[t * top_k + k] = -1;
}

// ---------------------------------------------------------------------------
// route_finish: per send slot, the token it carries (-1 past the filled
// slots) and the metadata words of its K members.
//   grid: ceil(R * S / blockDim.x); any block size.
//   inputs: topk_idx [T, K], topk_weights [T, K] float32, dest_totals [R].
//   outputs: send_token [R, S] (padding), meta id and weight words.
//   bounds: a token index outside [0, T) is treated as "no token".
// ---------------------------------------------------------------------------
extern "C" __global__ void route_finish(const int* __restrict__ topk_idx,
                                        const float* __restrict__ topk_weights, int num_tokens,
                                        int top_k, int num_experts, int local_experts,
                                        int ep_size, int send_capacity,
                                        const int* __restrict__ dest_totals,
                                        int* __restrict__ send_token, int* __restrict__ meta,
                                        int meta_width) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)ep_size * send_capacity) return;
  const int d = (int)(i / send_capacity), s = (int)(i % send_capacity);
  const int filled = min(dest_totals[d], send_capacity);
  int t = -1;
  if (s < filled) {
    t = send_token[i];
  } else {
    send_token[i] = -1;
  }
  if (t >= num_tokens) t = -1;
  int* row = meta + (i64)d * meta_width;
  const i64 members = (i64)send_capacity * top_k;
  for (int k = 0; k < top_k; ++k) {
    const int e = t >= 0 ? topk_idx[(i64)t * top_k + k] : -1;
    const bool on_rank = t >= 0 && valid_expert(e, num_experts) && e / local_experts == d;
    row[(i64)s * top_k + k] = on_rank ? e % local_experts : -1;
    row[members + (i64)s * top_k + k] =
        on_rank ? __float_as_int(topk_weights[(i64)t * top_k + k]) : 0;
  }
}

// ---------------------------------------------------------------------------
// Receiver. Member i = (src * S + s) * K + k of N = R * S * K; its key is the
// local expert id in meta[src, s * K + k] (outside [0, L): not routed).
// ---------------------------------------------------------------------------
__device__ __forceinline__ int member_key(const int* meta, i64 member, i64 num_members,
                                          int send_capacity, int top_k, int meta_width,
                                          int local_experts) {
  if (member >= num_members) return -1;
  const i64 per_src = (i64)send_capacity * top_k;
  const int key = meta[(member / per_src) * meta_width + member % per_src];
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

// ---------------------------------------------------------------------------
// slab_count: members per (tile, local expert).
//   grid: ceil(N / blockDim.x); block: 32 * warps; shared: warps * L ints.
//   output: tile_counts [tiles, L].
// ---------------------------------------------------------------------------
extern "C" __global__ void slab_count(const int* __restrict__ meta, int ep_size,
                                      int send_capacity, int top_k, int local_experts,
                                      int meta_width, int* __restrict__ tile_counts) {
  extern __shared__ int shared[];
  const int warps = blockDim.x / 32;
  int* warp_counts = shared;  // [warps, L]
  for (int i = threadIdx.x; i < warps * local_experts; i += blockDim.x) warp_counts[i] = 0;
  __syncthreads();
  const i64 num_members = (i64)ep_size * send_capacity * top_k;
  const i64 member = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  count_warp_keys(member_key(meta, member, num_members, send_capacity, top_k, meta_width,
                             local_experts),
                  warp_counts, local_experts);
  __syncthreads();
  for (int l = threadIdx.x; l < local_experts; l += blockDim.x) {
    int total = 0;
    for (int w = 0; w < warps; ++w) total += warp_counts[w * local_experts + l];
    tile_counts[(i64)blockIdx.x * local_experts + l] = total;
  }
}

// ---------------------------------------------------------------------------
// slab_scan: exclusive scan over tiles per local expert; counts (kept, at most
// C) and demand (the routes every source sent for it, before any drop).
//   grid: 1 block.  outputs: tile_offsets [tiles, L], counts [L], demand [L].
// ---------------------------------------------------------------------------
extern "C" __global__ void slab_scan(const int* __restrict__ tile_counts, int num_tiles,
                                     int local_experts, int expert_capacity, int ep_size,
                                     int meta_width, int demand_offset,
                                     const int* __restrict__ meta,
                                     int* __restrict__ tile_offsets, int* __restrict__ counts,
                                     int* __restrict__ demand) {
  for (int l = threadIdx.x; l < local_experts; l += blockDim.x) {
    int running = 0;
    for (int tile = 0; tile < num_tiles; ++tile) {
      tile_offsets[(i64)tile * local_experts + l] = running;
      running += tile_counts[(i64)tile * local_experts + l];
    }
    counts[l] = min(running, expert_capacity);
    int routes = 0;
    for (int src = 0; src < ep_size; ++src)
      routes += meta[(i64)src * meta_width + demand_offset + l];
    demand[l] = routes;
  }
}

// ---------------------------------------------------------------------------
// slab_rank: each member's slab position; members ranked >= C are dropped.
//   grid/block/shared: as slab_count.
//   outputs: recv_pos [N] (l * C + c or -1), slab_row [L, C] and
//   slab_weights [L, C] at kept positions (slab_pad fills the rest).
// ---------------------------------------------------------------------------
extern "C" __global__ void slab_rank(const int* __restrict__ meta, int ep_size, int send_capacity,
                                     int top_k, int local_experts, int expert_capacity,
                                     int meta_width, const int* __restrict__ tile_offsets,
                                     int* __restrict__ recv_pos, int* __restrict__ slab_row,
                                     float* __restrict__ slab_weights) {
  extern __shared__ int shared[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32;
  int* warp_counts = shared;  // [warps, L]
  for (int i = threadIdx.x; i < warps * local_experts; i += blockDim.x) warp_counts[i] = 0;
  __syncthreads();
  const i64 num_members = (i64)ep_size * send_capacity * top_k;
  const i64 member = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int key = member_key(meta, member, num_members, send_capacity, top_k, meta_width,
                             local_experts);
  const u32 peers = count_warp_keys(key, warp_counts, local_experts);
  __syncthreads();
  if (member >= num_members) return;
  if (key < 0) {
    recv_pos[member] = -1;
    return;
  }
  int pos = tile_offsets[(i64)blockIdx.x * local_experts + key] + __popc(peers & lanemask_lt());
  for (int w = 0; w < warp; ++w) pos += warp_counts[w * local_experts + key];
  if (pos >= expert_capacity) {
    recv_pos[member] = -1;
    return;
  }
  const i64 slab_index = (i64)key * expert_capacity + pos;
  const i64 per_src = (i64)send_capacity * top_k;
  recv_pos[member] = (int)slab_index;
  slab_row[slab_index] = (int)(member / top_k);
  slab_weights[slab_index] = __int_as_float(
      meta[(member / per_src) * meta_width + per_src + member % per_src]);
}

// ---------------------------------------------------------------------------
// slab_pad: slab rows at or past counts[l] hold no member.
//   grid: ceil(L * C / blockDim.x).  outputs: slab_row = -1, slab_weights = 0.
// ---------------------------------------------------------------------------
extern "C" __global__ void slab_pad(const int* __restrict__ counts, int local_experts,
                                    int expert_capacity, int* __restrict__ slab_row,
                                    float* __restrict__ slab_weights) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)local_experts * expert_capacity) return;
  if (i % expert_capacity >= counts[i / expert_capacity]) {
    slab_row[i] = -1;
    slab_weights[i] = 0.0f;
  }
}
