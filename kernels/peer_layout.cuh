// The metadata exchange and the receiver's slab layout done by a peer
// launch itself (peer_slab_layout_v16 in peer_layout.cu, peer_dispatch_layout
// in peer_dispatch.cu): the metadata rows read where they landed, and the
// layout job of a dispatch launch.

#ifndef MOE_EP_PEER_LAYOUT_CUH
#define MOE_EP_PEER_LAYOUT_CUH

#include "slab_layout.cuh"
#include "peer.cuh"
#include "peer_rows.cuh"

// Block-wide: where each source's metadata row is read this step (table
// [R] in shared memory: this rank's own, meta[rank]; another's, its slot
// on the channel at `own`), once thread 0 has waited for every other
// source's flag. A table, not per-call address arithmetic: the layout body
// beside it already needs ~62 of its 64 registers.
__device__ __forceinline__ const int* const* land_meta_rows(
    const int* meta, int meta_width, u64 own, i64 data_offset, i64 slot_bytes, int parity,
    u64 step, int rank, int ep_size, u32* failed, PeerFailure* record, u64 timeout_ns,
    int site) {
  __shared__ const int* rows[ROW_MAX_LANES];
  if (threadIdx.x < (unsigned)ep_size) {
    const int src = (int)threadIdx.x;
    rows[src] = src == rank ? meta + (i64)rank * meta_width
        : (const int*)slot_address(own, data_offset, parity, ep_size, slot_of(src, rank),
                                   slot_bytes);
  }
  if (threadIdx.x == 0)
    for (int src = 0; src < ep_size; ++src)
      if (src != rank)
        thread_wait(flag_of(own, ep_size, parity, src, 0), step, failed, record, timeout_ns,
                    PEER_WAIT_FLAG, src, site, rank, step);
  __syncthreads();
  return rows;
}

struct LandedMeta {  // slab_layout.cuh's Meta: each source's row where it landed
  const int* const* rows;  // [R] in shared memory: meta[rank], or src's slot here
  __device__ __forceinline__ int word(int src, int i) const {
    return __ldcg(rows[src] + i);  // stored by another GPU: not through L1
  }
};

// ---------------------------------------------------------------------------
// The metadata exchange and the receiver's slab layout done by a dispatch
// launch itself (peer_dispatch_layout; decode sizes, where every launch on
// the dispatch's path is latency): the metadata rows travel on their own
// channel (the drop-in exchange's for `meta`), pushed by the first sender
// blocks (meta_blocks per other rank) before their rows; the receiver blocks
// wait for every source's row, lay the slabs out (slab_layout.cuh: with few
// tiles slab_rank_own_count's work, else slab_count's and slab_rank's with
// a barrier between) into the handle's maps, meet at a barrier and then
// place rows by those maps (read through L2: this launch wrote them).
// The senders start on the rows at once and leave every own row to the
// receivers, so nothing on the sender side waits for the layout.
// ---------------------------------------------------------------------------
struct LayoutJob {
  const int* meta;        // [R, meta_width]: route's, row d for rank d
  const u64* meta_peers;  // [R] the metadata channel's bases
  i64 meta_slot_bytes;
  i64 meta_data_offset;
  int meta_width;         // 2 * S * K + L, a multiple of 4 (uint4 copies)
  int local_experts;
  int expert_capacity;
  int num_tiles;          // ceil(R * S * K / blockDim.x)
  int meta_blocks;        // sender blocks pushing each other rank's metadata row
  int* tile_counts;       // [num_tiles, L] scratch; null: every receiver block counts
                          // every tile itself (num_tiles <= receiver blocks)
  int* recv_pos;          // outputs, as slab_rank's
  int* slab_row;
  float* slab_weights;
  int* counts;
  int* demand;
};

__device__ __forceinline__ bool layout_job_ok(const LayoutJob& job, int ep_size,
                                              int send_capacity, int top_k, int num_slab_rows,
                                              int send_blocks) {
  const i64 members = (i64)ep_size * send_capacity * top_k;
  return job.local_experts >= 1 && job.expert_capacity >= 1 &&
         job.meta_width == meta_row_width(send_capacity, top_k, job.local_experts) &&
         job.meta_width % 4 == 0 && 4ll * job.meta_width <= job.meta_slot_bytes &&
         (i64)job.local_experts * job.expert_capacity == num_slab_rows &&
         job.meta_blocks >= 1 && (i64)job.meta_blocks * (ep_size - 1) <= send_blocks &&
         job.num_tiles >= 1 && (i64)job.num_tiles * blockDim.x >= members &&
         (job.tile_counts != nullptr || job.num_tiles <= (int)gridDim.x - send_blocks) &&
         4ll * ((blockDim.x / 32 + 2 + (job.tile_counts ? 0 : job.num_tiles)) *
                (i64)job.local_experts) <= dynamic_shared_bytes();
}

// This launch's step on the metadata channel (read once per block at its
// start; advanced by the launch's last block).
struct MetaExchange {
  u64 own;
  u64 step;
  int parity;
};

__device__ __forceinline__ MetaExchange open_meta_exchange(const u64* meta_peers, int rank,
                                                           int ep_size) {
  MetaExchange mx;
  mx.own = meta_peers[rank];
  mx.step = *(volatile u64*)step_of(mx.own, ep_size) + 1;
  mx.parity = (int)(mx.step & 1ull);
  return mx;
}

// Sender block b < (R - 1) * meta_blocks: its part of route's row for the
// (b / meta_blocks)-th other rank into that rank's metadata slot; the last
// of the row's blocks raises its flag (peer_send's protocol).
__device__ __forceinline__ void send_meta_row(const LayoutJob& job, const Exchange& ex, int b) {
  peer_send<uint4>((const uint4*)job.meta, nullptr, job.meta_peers, ex.rank, ex.ep_size,
                   job.meta_width / 4, job.meta_slot_bytes, job.meta_data_offset,
                   job.meta_blocks, 0, ex.failed, ex.record, ex.timeout_ns, ex.site, b);
}

// Receiver blocks' barrier number `round` (1, 2) of the launch: every block
// has arrived once per round; the count on the metadata channel's
// recv_done[0], which no other part of this launch uses.
__device__ void receivers_barrier(const MetaExchange& mx, const Exchange& ex, int receivers,
                                  int round) {
  __syncthreads();  // the block's stores are all issued
  if (threadIdx.x == 0) {
    u32* arrived = counters_of(mx.own, ex.ep_size) + ex.ep_size;
    __threadfence();  // release them to the other receivers
    atomicAdd(arrived, 1u);
    u64 waited_ns = 0;
    if (wait_at_least<u32>(arrived, (u32)(round * receivers), ex.failed, ex.timeout_ns,
                           &waited_ns) == 2)
      record_timeout(ex.failed, ex.record, PEER_WAIT_LAYOUT, ex.rank, ex.site, ex.rank, mx.step,
                     waited_ns);
  }
  __syncthreads();
}

// Receiver blocks: the slab layout, then their barrier (every map entry is
// written before any receiver reads one). The barrier counts on the metadata
// channel's recv_done[0], which no other part of this launch uses.
__device__ void lay_out_slabs(const LayoutJob& job, const MetaExchange& mx, const Exchange& ex,
                              int send_capacity, int top_k, int send_blocks) {
  const LandedMeta landed{land_meta_rows(job.meta, job.meta_width, mx.own, job.meta_data_offset,
                                         job.meta_slot_bytes, mx.parity, mx.step, ex.rank,
                                         ex.ep_size, ex.failed, ex.record, ex.timeout_ns,
                                         ex.site)};
  const int ep_size = ex.ep_size;
  const int receivers = (int)gridDim.x - send_blocks, block = (int)blockIdx.x - send_blocks;
  const int demand_offset = meta_demand_offset(send_capacity, top_k);
  if (job.tile_counts == nullptr) {  // few tiles: slab_rank_own_count's way, one round
    slab_rank_body<false>(landed, ep_size, send_capacity, top_k, job.local_experts,
                          job.expert_capacity, demand_offset, job.num_tiles, nullptr,
                          job.recv_pos, job.slab_row, job.slab_weights, job.counts, job.demand,
                          block, receivers);
    receivers_barrier(mx, ex, receivers, 1);
    return;
  }
  // Many tiles: slab_count's then slab_rank's grid, each strided over the
  // receiver blocks, a barrier after each.
  for (int tile = block; tile < job.num_tiles; tile += receivers) {
    count_slab_tile(landed, tile, ep_size, send_capacity, top_k, job.local_experts, shared,
                    job.tile_counts + (i64)tile * job.local_experts);
    __syncthreads();  // shared memory is reused
  }
  receivers_barrier(mx, ex, receivers, 1);
  const int slab_rows = job.local_experts * job.expert_capacity;
  const int rank_blocks = max(job.num_tiles, (slab_rows + (int)blockDim.x - 1) / (int)blockDim.x);
  for (int virtual_block = block; virtual_block < rank_blocks; virtual_block += receivers) {
    slab_rank_body<true>(landed, ep_size, send_capacity, top_k, job.local_experts,
                         job.expert_capacity, demand_offset, job.num_tiles, job.tile_counts,
                         job.recv_pos, job.slab_row, job.slab_weights, job.counts, job.demand,
                         virtual_block, rank_blocks);
    __syncthreads();  // shared memory is reused
  }
  receivers_barrier(mx, ex, receivers, 2);
}

// The end of every block: once all have passed it, rearms the receivers'
// barrier, acknowledges every source's metadata row and advances the
// metadata channel's step.
__device__ __forceinline__ void finish_meta_exchange(const LayoutJob& job,
                                                     const MetaExchange& mx,
                                                     const Exchange& ex) {
  if (!last_block_of_launch(mx.own, ex.ep_size)) return;
  counters_of(mx.own, ex.ep_size)[ex.ep_size] = 0u;
  acknowledge_step(job.meta_peers, mx.own, ex.rank, ex.ep_size, mx.parity, mx.step);
}

#endif  // MOE_EP_PEER_LAYOUT_CUH
