// Dispatch's metadata exchange fused with the receiver's slab layout
// (moe_ep/transport/peer/fused_layout.py): peer_slab_layout_v16. The layout
// is slab_layout.cuh's, the metadata landing peer_layout.cuh's (included below).

#include "common.cuh"
#include "slab_layout.cuh"
#include "peer.cuh"
#include "peer_rows.cuh"
#include "peer_layout.cuh"

// ---------------------------------------------------------------------------
// peer_slab_layout_v16: dispatch's metadata exchange and the
// receiver's slab layout (slab_rank_own_count, slab_layout.cuh) in one
// launch, for few member tiles (decode), where each launch is latency on
// the dispatch's critical path: no received metadata is copied out, and no
// second launch waits for the first.
//   blocks [0, R - 1): peer_send's remote blocks, one per other rank: meta[d]
//           into rank d's slot, then d's flag (after d's acknowledgement of
//           step s - 2).
//   blocks [R - 1, grid): slab_rank_own_count's grid (layout_blocks): each
//           waits for every other rank's flag, then ranks its tile reading
//           each source's row where it landed (its own rank's: meta[rank]).
//   The last block to finish acknowledges every source and advances the
//   step, as peer_exchange.
//   inputs:  meta [R, meta_width] int32 (route's: row d for rank d), peers
//            [R] channel bases (slots of meta_width * 4 bytes, in uint4).
//   outputs: as slab_rank: recv_pos [R * S * K], slab_row [L * C],
//            slab_weights [L * C], counts [L], demand [L].
//   shared:  as slab_rank_own_count.
//   bounds:  returns unless 2 <= ep_size <= 32, 0 <= rank < ep_size, the
//            grid holds the R - 1 senders and at least one layout block,
//            meta_width = 2 * S * K + L fits the slots and the dynamic shared
//            memory holds the layout's counts of num_tiles tiles; every read
//            of a source's row stays below meta_width.
// ---------------------------------------------------------------------------
__device__ __forceinline__ void peer_slab_layout(
    const int* __restrict__ meta, int* __restrict__ recv_pos, int* __restrict__ slab_row,
    float* __restrict__ slab_weights, int* __restrict__ counts, int* __restrict__ demand,
    const u64* __restrict__ peers, int rank, int ep_size, int send_capacity, int top_k,
    int local_experts, int expert_capacity, int meta_width, int num_tiles, i64 slot_bytes,
    i64 data_offset, u32* failed, PeerFailure* record, u64 timeout_ns, int site) {
  const int senders = ep_size - 1;
  const i64 meta_bytes = (i64)meta_width * 4;
  if (ep_size < 2 || ep_size > ROW_MAX_LANES || rank < 0 || rank >= ep_size ||
      (int)gridDim.x <= senders ||
      send_capacity < 1 || top_k < 1 || local_experts < 1 || expert_capacity < 1 ||
      num_tiles < 1 || meta_width != meta_row_width(send_capacity, top_k, local_experts) ||
      meta_bytes % (i64)sizeof(uint4) != 0 || meta_bytes > slot_bytes ||
      4ll * ((blockDim.x / 32 + 2 + num_tiles) * (i64)local_experts) > dynamic_shared_bytes())
    return;  // the last test: slab_rank_own_count's shared memory for num_tiles tiles
  const MetaExchange mx = open_meta_exchange(peers, rank, ep_size);
  if ((int)blockIdx.x < senders) {
    peer_send<uint4>((const uint4*)meta, nullptr, peers, rank, ep_size,
                     meta_bytes / sizeof(uint4), slot_bytes, data_offset, 1, 0, failed, record,
                     timeout_ns, site, blockIdx.x);
  } else {
    const LandedMeta landed{land_meta_rows(meta, meta_width, mx.own, data_offset, slot_bytes,
                                           mx.parity, mx.step, rank, ep_size, failed, record,
                                           timeout_ns, site)};
    slab_rank_body<false>(landed, ep_size, send_capacity, top_k, local_experts, expert_capacity,
                          meta_demand_offset(send_capacity, top_k), num_tiles, nullptr,
                          recv_pos, slab_row, slab_weights, counts, demand,
                          (int)blockIdx.x - senders, (int)gridDim.x - senders);
  }
  if (last_block_of_launch(mx.own, ep_size))
    acknowledge_step(peers, mx.own, rank, ep_size, mx.parity, mx.step);
}

// Metadata rows of whole 16-byte vectors only (fused_layout_fits): the
// narrower copies' variants spill beside the layout body.
extern "C" __global__ void __launch_bounds__(1024) peer_slab_layout_v16(
    const int* meta, int* recv_pos, int* slab_row, float* slab_weights, int* counts, int* demand,
    const u64* peers, int rank, int ep_size, int send_capacity, int top_k, int local_experts,
    int expert_capacity, int meta_width, int num_tiles, i64 slot_bytes, i64 data_offset,
    u32* failed, PeerFailure* record, u64 timeout_ns, int site) {
  peer_slab_layout(meta, recv_pos, slab_row, slab_weights, counts, demand, peers, rank, ep_size,
                   send_capacity, top_k, local_experts, expert_capacity, meta_width, num_tiles,
                   slot_bytes, data_offset, failed, record, timeout_ns, site);
}
