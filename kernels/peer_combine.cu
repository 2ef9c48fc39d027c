// Combine's fused row kernels (moe_ep/transport/peer/rows.py):
// peer_combine_{,own_first_}{f32,bf16,f16}. The protocol and the row
// machinery are peer.cuh's and peer_rows.cuh's (included below).

#include "common.cuh"
#include "peer.cuh"
#include "peer_rows.cuh"

// ---------------------------------------------------------------------------
// peer_combine_{,own_first_}{f32,bf16,f16}: slabs [L * C, H] of every rank -> y [T, H],
// one exchange.
//   senders:   chunk (q, d): for slot s of the chunk (the row d sent here in
//              slot s), the float32 sum of its members' slab rows in member
//              order, rounded once, stored into row s of this rank's slot on
//              d (zero where every member was dropped for capacity, -2 in
//              recv_pos): gather_sum_rows over recv_pos. A slot d sent no
//              row in (every member -1) is never read back and not stored.
//   receivers: token units, warps striding: y[t] = the float32 sum over ranks d = 0, 1, ... of
//              the row t sent to d as it came back: from d's slot for d !=
//              rank (lane d waits for its chunk's flag first), and for d ==
//              rank this rank's own member sum, rounded to Elem and widened
//              again (what gather_sum_rows over the wire rows reads);
//              rounded once at the end.
//   own first: peer_combine_own_first_* (decode sizes, the Python side's
//              rule): the receivers first store every token's own member
//              sum, so rounded, into y, and only then wait for the other
//              ranks' rows and read it back (the same thread: the same
//              unit-to-warp and vector-to-lane mapping), so that the own
//              members' reads overlap the other ranks' sending: the same
//              bits, y stored twice.
//   grid:      send_blocks + at least one receiver block, 32 * w threads.
//   inputs:    slabs [L * C, row_elems], recv_pos [R * S, K], send_slot [T,
//              R] int32; peers [R] channel bases.
//   output:    y [T, row_elems].
//   bounds:    see the section comment; row_elems * sizeof(Elem) % 16 == 0.
// ---------------------------------------------------------------------------
template <typename T, bool kOwnFirst>
__device__ __forceinline__ void peer_combine(
    const typename T::Elem* __restrict__ slabs, const int* __restrict__ recv_pos,
    const int* __restrict__ send_slot, typename T::Elem* __restrict__ y,
    const u64* __restrict__ peers, int rank, int ep_size, int num_tokens, int send_capacity,
    int top_k, int num_slab_rows, int row_elems, int chunk_rows, int num_chunks,
    int send_blocks, int send_segment_vecs, int recv_segment_vecs, i64 slot_bytes,
    i64 data_offset, u32* failed, PeerFailure* record, u64 timeout_ns, int site) {
  constexpr int kPerVec = 16 / sizeof(typename T::Elem);
  const int row_vecs = row_elems / kPerVec;
  const Chunks c{send_capacity, chunk_rows, num_chunks, send_blocks};
  if (!row_args_ok(rank, ep_size, send_capacity, top_k, num_slab_rows, row_vecs,
                   send_segment_vecs) ||
      row_elems % kPerVec != 0 || recv_segment_vecs < 1 || num_tokens < 1 || !chunks_ok(c))
    return;
  const Exchange ex = open_exchange(peers, rank, ep_size, slot_bytes, data_offset, failed, record,
                                    timeout_ns, site);
  const uint4* table = (const uint4*)slabs;
  if ((int)blockIdx.x < send_blocks) {
    const int segments = (row_vecs + send_segment_vecs - 1) / send_segment_vecs;
    send_chunks(ex, c, segments, send_segment_vecs, row_vecs, row_vecs,
                [&](int dest, i64 s, const RowUnit& u, uint4* out) {
                  const i64 row = (i64)dest * send_capacity + s;
                  const int member = member_row(recv_pos, row, top_k, num_slab_rows);
                  const u32 members = __ballot_sync(MOE_EP_FULL_MASK, member >= 0);
                  if (members == 0u && !slot_held_row(recv_pos, row, top_k)) return;
                  for (int base = u.begin; base < u.end; base += 32 * ROW_SUM_UNROLL) {
                    float acc[ROW_SUM_UNROLL][kPerVec];
                    zero_sums(acc);
                    add_members<T, ROW_SUM_UNROLL>(table, row_vecs, member, members, base, u.end,
                                                   acc);
                    store_sums<T, ROW_SUM_UNROLL>(acc, out, base, u.end);
                  }
                });
    finish_exchange(ex);
    return;
  }
  const int lane = lane_index();
  // Lane d: the slot rank d's sums of this rank's rows arrive in.
  const u64 slot_base =
      (lane < ep_size && lane != rank) ? (u64)slot_on(ex, ex.own, lane, rank) : 0ull;
  int seen = -1;  // lane d: the chunk of d's slot it last waited for
  const int segments = (row_vecs + recv_segment_vecs - 1) / recv_segment_vecs;
  const i64 units = (i64)num_tokens * segments;
  const i64 warps = receiver_warps(send_blocks);
  if constexpr (kOwnFirst) {  // every unit's own member sum into y before any wait
    for (i64 unit = receiver_warp(send_blocks); unit < units; unit += warps) {
      const RowUnit u = row_unit(unit, segments, recv_segment_vecs, row_vecs);
      const int own_slot = __shfl_sync(MOE_EP_FULL_MASK,
                                       sent_slot(send_slot, u.row, ep_size, send_capacity), rank);
      if (own_slot < 0) continue;  // warp-uniform
      const int member =
          member_row(recv_pos, (i64)rank * send_capacity + own_slot, top_k, num_slab_rows);
      const u32 members = __ballot_sync(MOE_EP_FULL_MASK, member >= 0);
      for (int base = u.begin; base < u.end; base += 32 * ROW_SUM_UNROLL) {
        float part[ROW_SUM_UNROLL][kPerVec];
        zero_sums(part);
        add_members<T, ROW_SUM_UNROLL>(table, row_vecs, member, members, base, u.end, part);
        store_sums<T, ROW_SUM_UNROLL>(part, (uint4*)y + u.row * row_vecs, base, u.end);
      }
    }
  }
  for (i64 unit = receiver_warp(send_blocks); unit < units; unit += warps) {
    const RowUnit u = row_unit(unit, segments, recv_segment_vecs, row_vecs);
    const int slot = sent_slot(send_slot, u.row, ep_size, send_capacity);
    if (slot >= 0 && lane != rank && slot / chunk_rows != seen) {
      thread_wait(flag_of(ex.own, ep_size, ex.parity, lane, slot / chunk_rows), ex.step, failed,
                  record, timeout_ns, PEER_WAIT_FLAG, lane, site, rank, ex.step);
      seen = slot / chunk_rows;
    }
    __syncwarp();
    const int own_slot = __shfl_sync(MOE_EP_FULL_MASK, slot, rank);
    const int member = own_slot < 0 ? -1
        : member_row(recv_pos, (i64)rank * send_capacity + own_slot, top_k, num_slab_rows);
    const u32 members = __ballot_sync(MOE_EP_FULL_MASK, member >= 0);
    // Ranks whose wire row of t is absent add +0.0 in gather_sum_rows: skipped
    // here, the same bits (see add_members).
    const u32 ranks = __ballot_sync(MOE_EP_FULL_MASK, slot >= 0);
    uint4* out = (uint4*)y + u.row * row_vecs;
    for (int base = u.begin; base < u.end; base += 32 * ROW_SUM_UNROLL) {
      float acc[ROW_SUM_UNROLL][kPerVec];
      zero_sums(acc);
      for (u32 m = ranks; m != 0u; m &= m - 1u) {
        const int d = __ffs(m) - 1;
        if (kOwnFirst && d == rank) {  // stored above by this thread
          uint4 values[ROW_SUM_UNROLL];
          load_step<ROW_SUM_UNROLL, true>(out, base, u.end, values);
#pragma unroll
          for (int i = 0; i < ROW_SUM_UNROLL; ++i) add_vector<T>(values[i], acc[i]);
        } else if (d == rank) {
          float part[ROW_SUM_UNROLL][kPerVec];
          zero_sums(part);
          add_members<T, ROW_SUM_UNROLL>(table, row_vecs, member, members, base, u.end, part);
#pragma unroll
          for (int i = 0; i < ROW_SUM_UNROLL; ++i)
#pragma unroll
            for (int e = 0; e < kPerVec; ++e) acc[i][e] += T::load(T::store(part[i][e]));
        } else {
          const uint4* row = (const uint4*)__shfl_sync(MOE_EP_FULL_MASK, slot_base, d) +
                             (i64)__shfl_sync(MOE_EP_FULL_MASK, slot, d) * row_vecs;
          uint4 values[ROW_SUM_UNROLL];
          load_step<ROW_SUM_UNROLL, true>(row, base, u.end, values);
#pragma unroll
          for (int i = 0; i < ROW_SUM_UNROLL; ++i) add_vector<T>(values[i], acc[i]);
        }
      }
      store_sums<T, ROW_SUM_UNROLL>(acc, out, base, u.end);
    }
  }
  finish_exchange(ex);
}

// Two instances each: the in-order receivers' code is not shaped by the
// own-first pass (sharing one body behind a flag made P2's combine slower:
// docs/benchmarks.md, "Tuning").
#define DEFINE_PEER_COMBINE_KERNEL(NAME, TYPE, OWN_FIRST)                                       \
  extern "C" __global__ void __launch_bounds__(512, 1) NAME(                                    \
      const TYPE::Elem* slabs, const int* recv_pos, const int* send_slot, TYPE::Elem* y,        \
      const u64* peers, int rank, int ep_size, int num_tokens, int send_capacity, int top_k,    \
      int num_slab_rows, int row_elems, int chunk_rows, int num_chunks, int send_blocks,        \
      int send_segment_vecs, int recv_segment_vecs, i64 slot_bytes, i64 data_offset,           \
      u32* failed, PeerFailure* record, u64 timeout_ns, int site) {                             \
    peer_combine<TYPE, OWN_FIRST>(slabs, recv_pos, send_slot, y, peers, rank, ep_size,          \
                                  num_tokens, send_capacity, top_k, num_slab_rows, row_elems,   \
                                  chunk_rows, num_chunks, send_blocks, send_segment_vecs,       \
                                  recv_segment_vecs, slot_bytes, data_offset, failed, record,   \
                                  timeout_ns, site);                                            \
  }

DEFINE_PEER_COMBINE_KERNEL(peer_combine_f32, F32, false)
DEFINE_PEER_COMBINE_KERNEL(peer_combine_bf16, BF16, false)
DEFINE_PEER_COMBINE_KERNEL(peer_combine_f16, F16, false)
DEFINE_PEER_COMBINE_KERNEL(peer_combine_own_first_f32, F32, true)
DEFINE_PEER_COMBINE_KERNEL(peer_combine_own_first_bf16, BF16, true)
DEFINE_PEER_COMBINE_KERNEL(peer_combine_own_first_f16, F16, true)
