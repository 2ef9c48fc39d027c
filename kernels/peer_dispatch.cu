// Dispatch's fused row kernels (moe_ep/transport/peer/rows.py and
// dispatch_layout.py): peer_dispatch, peer_dispatch_layout and
// peer_dispatch_fp8_{f32,bf16,f16}. The protocol and the row machinery are
// peer.cuh's and peer_rows.cuh's, the layout job peer_layout.cuh's, the FP8
// quantize step fp8.cuh's (all included below).

#include "common.cuh"
#include "fp8.cuh"
#include "slab_layout.cuh"
#include "peer.cuh"
#include "peer_rows.cuh"
#include "peer_layout.cuh"

// Where token t's row goes, as the maps say (warp-wide, t warp-uniform): its
// wire rows are the (rank d, slot s) with send_slot[t, d] = s in [0, S) and
// send_token[d * S + s] = t. own_slot: this rank's slot, or -1. first_remote:
// the lowest other rank with a wire row of t, or -1, and first_remote_slot
// its slot. The sender of that row also places the own row in this rank's
// slabs (so the token row is read, and FP8-quantized, once); the receivers'
// own-rows pass skips it.
struct TokenWires {
  int own_slot;
  int first_remote;
  int first_remote_slot;
};

__device__ __forceinline__ TokenWires token_wires(const int* __restrict__ send_slot,
                                                  const int* __restrict__ send_token, int token,
                                                  int rank, int ep_size, int send_capacity) {
  const int lane = lane_index();
  int slot = lane < ep_size ? __ldg(send_slot + (i64)token * ep_size + lane) : -1;
  if (slot >= send_capacity ||
      (slot >= 0 && __ldg(send_token + (i64)lane * send_capacity + slot) != token))
    slot = -1;
  const u32 wired = __ballot_sync(MOE_EP_FULL_MASK, slot >= 0);
  const u32 remote = wired & ~(1u << rank);
  TokenWires w;
  w.own_slot = __shfl_sync(MOE_EP_FULL_MASK, slot, rank);
  w.first_remote = remote != 0u ? __ffs(remote) - 1 : -1;
  w.first_remote_slot = __shfl_sync(MOE_EP_FULL_MASK, slot, remote != 0u ? w.first_remote : 0);
  return w;
}

// How dispatch's senders and its own-rows receivers turn token t into its
// wire row (the row that travels and lands in the slabs), `units()` units per
// row. CopyRows: the rows are already wire rows, units are 16-byte vectors.
// QuantizeRows<T>: FP8 dispatch, each T row quantized on the way (fp8.cuh's
// warp step), units are quantize steps of FP8_STEP_CHANNELS channels.
// kZeroesPadding: whether the receivers zero the slabs' padding rows. Slabs
// of copied rows feed the expert GEMMs, whose weight gradients multiply
// every row (stale bits could make 0 * NaN); FP8 slabs' one reader is the
// dequantize, which zeroes every row no member fills (the backends'
// dequantize_filled_rows), so their padding is left unwritten.
struct CopyRows {
  static constexpr bool kVectorUnits = true;
  static constexpr bool kZeroesPadding = true;
  const uint4* __restrict__ rows;  // [T, row_vecs]
  int row_vecs;

  __device__ __forceinline__ bool fits(int wire_row_vecs) const { return row_vecs == wire_row_vecs; }
  __device__ __forceinline__ int units() const { return row_vecs; }

  // Units [u.begin, u.end) of token t's wire row into `out` (one wire row;
  // none if null) and into the slab rows of the members in `members` (lane k
  // holds member k's slab row).
  __device__ __forceinline__ void place(int token, const RowUnit& u, uint4* __restrict__ out,
                                        uint4* __restrict__ slabs, int member, u32 members) const {
    copy_to_members<false>(rows + (i64)token * row_vecs, out, slabs, row_vecs, member, members, u);
  }
};

template <typename T>
struct QuantizeRows {
  static constexpr bool kVectorUnits = false;
  static constexpr bool kZeroesPadding = false;
  const typename T::Elem* __restrict__ rows;  // [T, hidden], hidden % 16 == 0
  int hidden;
  int row_vecs;  // W / 16, the kernel's argument (fp8.py's wire_bytes)

  __device__ __forceinline__ int code_vecs() const { return hidden / 16; }
  __device__ __forceinline__ int units() const {
    return (hidden + FP8_STEP_CHANNELS - 1) / FP8_STEP_CHANNELS;
  }
  // A wire row: hidden / 16 code vectors, one vector of 4 scales per step,
  // then zero vectors up to row_vecs (at most 31: lanes 1 .. 31 of the last
  // step store them).
  __device__ __forceinline__ bool fits(int wire_row_vecs) const {
    const int padding = row_vecs - code_vecs() - units();
    return hidden >= 16 && hidden % 16 == 0 && wire_row_vecs == row_vecs && padding >= 0 &&
           padding <= 31;
  }

  // Steps [u.begin, u.end) of token t, kBatch loaded before any is
  // quantized (8 vectors in flight per lane): emit(step, codes, scales) per
  // step, warp-wide (the stores are the caller's).
  static constexpr int kBatch = 8 / sizeof(typename T::Elem);

  template <typename Emit>
  __device__ __forceinline__ void quantize(int token, const RowUnit& u, Emit emit) const {
    const typename T::Elem* row = rows + (i64)token * hidden;
    for (int step = u.begin; step < u.end; step += kBatch) {
      uint4 raw[kBatch][sizeof(typename T::Elem)];
#pragma unroll
      for (int i = 0; i < kBatch; ++i)  // a step past the unit: hidden 0, zeros
        fp8_load_sixteen<T>(row, step + i < u.end ? hidden : 0, step + i, raw[i]);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (step + i < u.end) {
          float v[16];
          fp8_widen_sixteen<T>(raw[i], v);
          uint4 scales;
          const uint4 codes = fp8_quantize_sixteen(v, hidden, step + i, &scales);
          emit(step + i, codes, scales);
        }
      }
    }
  }

  // Stores one step's codes (lanes whose channels are in the row) and scales
  // (lane 0) into the wire row `out`; the last step also its zero vectors
  // (lanes 1 .. 31).
  __device__ __forceinline__ void store(uint4* __restrict__ out, int step, uint4 codes,
                                        uint4 scales) const {
    const int lane = lane_index();
    const int v = step * 32 + lane;
    if (v < code_vecs()) out[v] = codes;
    if (lane == 0) out[code_vecs() + step] = scales;
    const int padding = code_vecs() + units() + lane - 1;
    if (step == units() - 1 && lane >= 1 && padding < row_vecs)
      out[padding] = make_uint4(0u, 0u, 0u, 0u);
  }

  // As CopyRows::place, each step quantized once for all its stores.
  __device__ __forceinline__ void place(int token, const RowUnit& u, uint4* __restrict__ out,
                                        uint4* __restrict__ slabs, int member, u32 members) const {
    quantize(token, u, [&](int step, uint4 codes, uint4 scales) {
      if (out != nullptr) store(out, step, codes, scales);
      for (u32 m = members; m != 0u; m &= m - 1u) {
        const int n = __shfl_sync(MOE_EP_FULL_MASK, member, __ffs(m) - 1);
        store(slabs + (i64)n * row_vecs, step, codes, scales);
      }
    });
  }
};

// ---------------------------------------------------------------------------
// peer_dispatch: rows [T, H] -> slabs [L * C, H] of every rank, one exchange.
// peer_dispatch_fp8_{f32,bf16,f16}: rows [T, hidden] -> FP8 slabs [L * C, W]
// uint8 (fp8.cuh's wire rows), the same exchange with each token quantized
// by the warp that sends or places it (hidden % 16 == 0), so no separate
// quantize pass: the bytes of quantize_pack followed by peer_dispatch.
//   senders:   chunk (q, d): for slot s of the chunk, token t = send_token[d *
//              S + s] (if in [0, T)) stored into row s of this rank's slot on
//              d; if d is t's first remote rank (token_wires), t's own row
//              too, from the same loads, into its members' slab rows here.
//   receivers: units in this order, warps striding: (1) padding slab rows
//              n (slab_row[n] outside [0, R * S)) zeroed, each warp loading
//              the slab_row entries of its next 32 units of (1) at once
//              (FP8: none; its padding rows are left unwritten);
//              (2) this rank's own slots s whose token goes to no other
//              rank: token send_token[rank * S + s] copied into its members'
//              slab rows;
//              (3) the other ranks' slots, chunk by chunk in q-major order:
//              wait for the chunk's flag, copy row s of src's slot into the
//              members recv_pos[src * S + s].
//   units:     (1) and (3) split rows of row_vecs into segments of
//              recv_segment vectors; (2) and the senders split the rows as
//              the source row's units (peer_dispatch: vectors, segments of
//              recv_segment and send_segment; FP8: quantize steps, (2) in as
//              many segments as (1), the senders in segments of send_segment
//              steps).
//   grid:      send_blocks + at least one receiver block, 32 * w threads.
//   inputs:    rows [T, row_vecs] uint4 (FP8: [T, hidden] T::Elem),
//              send_token [R * S], send_slot [T, R], recv_pos [R * S, K],
//              slab_row [L * C] int32; peers [R] channel bases.
//   output:    slabs [L * C, row_vecs] uint4, every row written once (FP8:
//              every row that a member fills).
// ---------------------------------------------------------------------------
template <typename Source, bool kLayout = false>
__device__ __forceinline__ void dispatch_rows(
    const Source& source, const int* __restrict__ send_token, const int* __restrict__ send_slot,
    const int* __restrict__ recv_pos, const int* __restrict__ slab_row,
    uint4* __restrict__ slabs, const u64* __restrict__ peers,
    int rank, int ep_size, int num_tokens, int send_capacity, int top_k, int num_slab_rows,
    int row_vecs, int chunk_rows, int num_chunks, int send_blocks, int send_segment,
    int recv_segment_vecs, i64 slot_bytes, i64 data_offset, u32* failed, PeerFailure* record,
    u64 timeout_ns, int site, const LayoutJob& job = LayoutJob{}) {
  const Chunks c{send_capacity, chunk_rows, num_chunks, send_blocks};
  if (!row_args_ok(rank, ep_size, send_capacity, top_k, num_slab_rows, row_vecs, send_segment) ||
      !source.fits(row_vecs) || recv_segment_vecs < 1 || num_tokens < 1 || !chunks_ok(c))
    return;
  if (kLayout && !layout_job_ok(job, ep_size, send_capacity, top_k, num_slab_rows, send_blocks))
    return;
  const Exchange ex = open_exchange(peers, rank, ep_size, slot_bytes, data_offset, failed, record,
                                    timeout_ns, site);
  const MetaExchange mx =
      kLayout ? open_meta_exchange(job.meta_peers, rank, ep_size) : MetaExchange{};
  const i64 wire_rows = (i64)ep_size * send_capacity;
  const int source_units = source.units();
  if ((int)blockIdx.x < send_blocks) {
    if (kLayout && (int)blockIdx.x < (ep_size - 1) * job.meta_blocks)
      send_meta_row(job, ex, blockIdx.x);
    const int segments = (source_units + send_segment - 1) / send_segment;
    send_chunks(ex, c, segments, send_segment, source_units, row_vecs,
                [&](int dest, i64 s, const RowUnit& u, uint4* out) {
                  const int token = __ldg(send_token + (i64)dest * send_capacity + s);
                  if (token < 0 || token >= num_tokens) return;
                  int member = -1;  // with kLayout the receivers place every own row
                  if constexpr (!kLayout) {
                    const TokenWires w =
                        token_wires(send_slot, send_token, token, rank, ep_size, send_capacity);
                    if (w.own_slot >= 0 && w.first_remote == dest && w.first_remote_slot == s)
                      member = member_row(recv_pos, (i64)rank * send_capacity + w.own_slot,
                                          top_k, num_slab_rows);
                  }
                  const u32 members = __ballot_sync(MOE_EP_FULL_MASK, member >= 0);
                  source.place(token, u, out, slabs, member, members);
                });
    finish_exchange(ex);
    if constexpr (kLayout) finish_meta_exchange(job, mx, ex);
    return;
  }
  if constexpr (kLayout) lay_out_slabs(job, mx, ex, send_capacity, top_k, send_blocks);
  const int segments = (row_vecs + recv_segment_vecs - 1) / recv_segment_vecs;
  const int own_segment = Source::kVectorUnits ? recv_segment_vecs
                                               : (source_units + segments - 1) / segments;
  const i64 padding_units = Source::kZeroesPadding ? (i64)num_slab_rows * segments : 0;
  const i64 own_units = (i64)send_capacity * segments;
  const i64 chunk_units = (i64)chunk_rows * segments;
  const int others = ep_size - 1;
  const i64 units = padding_units + own_units + (i64)num_chunks * others * chunk_units;
  const i64 warps = receiver_warps(send_blocks);
  int seen = -1;
  // Lane j: slab_row of this warp's unit `(done & ~31) + j` of (1). Loaded 32
  // at a time, so a unit's test is a shuffle, not a load the warp waits for
  // (at decode sizes most units are (1) and most of the kernel was these waits).
  int padding_test = -1;
  i64 done = 0;  // this warp's units so far
  for (i64 unit = receiver_warp(send_blocks); unit < units; unit += warps, ++done) {
    if (unit < padding_units) {  // (1) zero the padding rows
      if ((done & 31) == 0) {
        const i64 mine = unit + lane_index() * warps;
        padding_test = mine < padding_units ? map_entry<kLayout>(slab_row, mine / segments) : -1;
      }
      const int m = __shfl_sync(MOE_EP_FULL_MASK, padding_test, (int)(done & 31));
      if (m >= 0 && m < wire_rows) continue;
      const RowUnit u = row_unit(unit, segments, recv_segment_vecs, row_vecs);
      for (int v = u.begin + lane_index(); v < u.end; v += 32)
        slabs[u.row * row_vecs + v] = make_uint4(0u, 0u, 0u, 0u);
    } else if (unit < padding_units + own_units) {  // (2) this rank's own rows
      const RowUnit u = row_unit(unit - padding_units, segments, own_segment, source_units);
      const i64 wire = (i64)rank * send_capacity + u.row;
      const int member = member_row<kLayout>(recv_pos, wire, top_k, num_slab_rows);
      const u32 members = __ballot_sync(MOE_EP_FULL_MASK, member >= 0);
      const int token = __ldg(send_token + wire);
      if (members == 0u || token < 0 || token >= num_tokens) continue;
      if constexpr (!kLayout) {
        const TokenWires w =
            token_wires(send_slot, send_token, token, rank, ep_size, send_capacity);
        if (w.own_slot == u.row && w.first_remote >= 0) continue;  // its sender places it
      }
      source.place(token, u, nullptr, slabs, member, members);
    } else {  // (3) the other ranks' rows, chunk by chunk
      const i64 rest = unit - padding_units - own_units;
      const i64 chunk = rest / chunk_units;
      const int q = (int)(chunk / others), nth = (int)(chunk % others);
      const int src = nth < rank ? nth : nth + 1;
      const RowUnit u = row_unit(rest % chunk_units, segments, recv_segment_vecs, row_vecs);
      const i64 s = (i64)q * chunk_rows + u.row;
      if (s >= send_capacity) continue;
      const int member = member_row<kLayout>(recv_pos, (i64)src * send_capacity + s, top_k,
                                             num_slab_rows);
      const u32 members = __ballot_sync(MOE_EP_FULL_MASK, member >= 0);
      if (members == 0u) continue;
      warp_wait_chunk(ex, src, q, &seen);
      copy_to_members<true>(slot_on(ex, ex.own, src, rank) + s * row_vecs, nullptr, slabs,
                            row_vecs, member, members, u);
    }
  }
  finish_exchange(ex);
  if constexpr (kLayout) finish_meta_exchange(job, mx, ex);
}

extern "C" __global__ void __launch_bounds__(512, 1) peer_dispatch(
    const uint4* __restrict__ rows, const int* __restrict__ send_token,
    const int* __restrict__ send_slot, const int* __restrict__ recv_pos,
    const int* __restrict__ slab_row, uint4* __restrict__ slabs, const u64* __restrict__ peers,
    int rank, int ep_size, int num_tokens, int send_capacity, int top_k, int num_slab_rows,
    int row_vecs, int chunk_rows, int num_chunks, int send_blocks, int send_segment_vecs,
    int recv_segment_vecs, i64 slot_bytes, i64 data_offset, u32* failed, PeerFailure* record,
    u64 timeout_ns, int site) {
  dispatch_rows(CopyRows{rows, row_vecs}, send_token, send_slot, recv_pos, slab_row, slabs,
                peers, rank, ep_size, num_tokens, send_capacity, top_k, num_slab_rows, row_vecs,
                chunk_rows, num_chunks, send_blocks, send_segment_vecs, recv_segment_vecs,
                slot_bytes, data_offset, failed, record, timeout_ns, site);
}

// peer_dispatch_layout: peer_dispatch with the metadata exchange and the
// slab layout in the same launch (LayoutJob, peer_layout.cuh): route's outputs in,
// slabs and the handle's maps out. Extra inputs: meta [R, meta_width];
// outputs recv_pos [R * S * K], slab_row [L * C], slab_weights [L * C],
// counts [L], demand [L] (as slab_rank) and tile_counts [num_tiles, L]
// scratch; after `site` the metadata channel's bases, slot bytes and data
// offset, the sender blocks per other rank's metadata row, and `counted`
// (0: few tiles, each receiver block counts them all and tile_counts is not
// used). Dynamic shared memory: the layout's (slab_rank's, or
// slab_rank_own_count's for num_tiles tiles).
extern "C" __global__ void __launch_bounds__(512, 1) peer_dispatch_layout(
    const uint4* __restrict__ rows, const int* __restrict__ send_token,
    const int* __restrict__ send_slot, const int* __restrict__ meta, uint4* __restrict__ slabs,
    int* recv_pos, int* slab_row, float* slab_weights, int* counts, int* demand,
    int* tile_counts, const u64* __restrict__ peers, int rank, int ep_size, int num_tokens,
    int send_capacity,
    int top_k, int num_slab_rows, int row_vecs, int local_experts, int expert_capacity,
    int meta_width, int num_tiles, int chunk_rows, int num_chunks, int send_blocks,
    int send_segment_vecs, int recv_segment_vecs, i64 slot_bytes, i64 data_offset, u32* failed,
    PeerFailure* record, u64 timeout_ns, int site, const u64* __restrict__ meta_peers,
    i64 meta_slot_bytes, i64 meta_data_offset, int meta_blocks, int counted) {
  const LayoutJob job{meta, meta_peers, meta_slot_bytes, meta_data_offset, meta_width,
                      local_experts, expert_capacity, num_tiles, meta_blocks,
                      counted ? tile_counts : nullptr, recv_pos, slab_row, slab_weights, counts,
                      demand};
  dispatch_rows<CopyRows, true>(CopyRows{rows, row_vecs}, send_token, send_slot, recv_pos,
                                slab_row, slabs, peers, rank, ep_size, num_tokens, send_capacity,
                                top_k, num_slab_rows, row_vecs, chunk_rows, num_chunks,
                                send_blocks, send_segment_vecs, recv_segment_vecs, slot_bytes,
                                data_offset, failed, record, timeout_ns, site, job);
}

#define DEFINE_PEER_DISPATCH_FP8_KERNEL(SUFFIX, TYPE)                                            \
  extern "C" __global__ void __launch_bounds__(512, 1) peer_dispatch_fp8_##SUFFIX(               \
      const TYPE::Elem* __restrict__ rows, const int* __restrict__ send_token,                   \
      const int* __restrict__ send_slot, const int* __restrict__ recv_pos,                       \
      const int* __restrict__ slab_row, uint4* __restrict__ slabs, const u64* __restrict__ peers, \
      int rank, int ep_size, int num_tokens, int send_capacity, int top_k, int num_slab_rows,    \
      int row_vecs, int hidden,                                                                  \
      int chunk_rows, int num_chunks, int send_blocks, int send_segment_steps,                   \
      int recv_segment_vecs, i64 slot_bytes, i64 data_offset, u32* failed, PeerFailure* record,  \
      u64 timeout_ns, int site) {                                                                \
    dispatch_rows(QuantizeRows<TYPE>{rows, hidden, row_vecs}, send_token, send_slot, recv_pos,   \
                  slab_row, slabs, peers, rank, ep_size, num_tokens, send_capacity, top_k,       \
                  num_slab_rows, row_vecs, chunk_rows, num_chunks, send_blocks,                  \
                  send_segment_steps, recv_segment_vecs, slot_bytes, data_offset, failed,        \
                  record, timeout_ns, site);                                                     \
  }

DEFINE_PEER_DISPATCH_FP8_KERNEL(f32, F32)
DEFINE_PEER_DISPATCH_FP8_KERNEL(bf16, BF16)
DEFINE_PEER_DISPATCH_FP8_KERNEL(f16, F16)
