// Direct peer exchange: the all_to_all of one [R, chunk] buffer over the EP
// group, done by storing each chunk straight into the destination GPU's memory
// (NVLink peer access in one process, CUDA IPC mappings across processes).
//
// Each device holds one "channel" allocation per (group, chunk size), written
// by its peers; `peers[r]` is rank r's allocation as mapped on this device
// (`peers[rank]` is this device's own). Byte offsets inside one allocation,
// with R = ep_size and M = PEER_MAX_CHUNKS (moe_ep/transport/peer.py's
// ChannelLayout computes the same):
//   flags    u64[2][R][M] at 0:       flags[p][src][q] = last step whose piece
//                                     q src has fully delivered into this
//                                     device's parity-p slot (stored by src).
//                                     The drop-in exchange uses piece 0 only;
//                                     the fused row kernels one per chunk of
//                                     rows, so the receiver starts on the
//                                     first chunks while later ones travel.
//   acks     u64[2][R]    at 16RM:    acks[p][dst] = last step at which dst
//                                     finished reading what this device put
//                                     in dst's parity-p slot (stored by dst).
//   step     u64          at 16RM+16R: exchanges completed on this channel.
//   counters u32[2R + 2]  after step: send_done[R], recv_done[R],
//                                     recv_sources, blocks_done.
//   data     at data_offset:           slots [2][R - 1] of slot_bytes; source
//                                     src's chunk lands in slot
//                                     (p, src < me ? src : src - 1).
//
// One exchange = one launch: peer_exchange (peer_send's and peer_recv's
// blocks in one grid; the write ceiling runs the two as separate launches),
// or a fused row kernel at the end of this file (peer_dispatch,
// peer_combine_*: the same protocol, rows moved straight between dispatch's
// and combine's XLA buffers and the slots, sender and receiver blocks in one
// grid). Every kernel reads s = step + 1 and parity p = s & 1; the last block
// of the exchange to finish stores step = s, so every launch has the same
// arguments (CUDA-graph replayable) and the counters agree because every rank
// runs the same sequence of exchanges.
// Every spin-wait is bounded: on timeout the first waiter of the device sets
// `failed` and writes a PeerFailure into host-mapped memory; later waits on
// the device return at once (the results are then garbage, and Python raises).

#define PEER_UNROLL 4
#define PEER_MAX_CHUNKS 1024  // flags per (parity, source): chunks of one fused exchange

// What a timed-out wait was waiting for (PeerFailure::kind).
#define PEER_WAIT_ACK 1   // sender: for the peer to acknowledge step - 2
#define PEER_WAIT_FLAG 2  // receiver: for the peer's chunk of this step
#define PEER_WAIT_LAYOUT 3  // peer_dispatch_layout's receivers: for each other's slab maps

typedef unsigned long long u64;

struct PeerFailure {  // 32 bytes, mirrored by peer.py's _Failure
  u32 kind;
  u32 peer;
  u32 site;
  u32 rank;
  u64 step;
  u64 waited_ns;
};

__device__ __forceinline__ u64 global_ns() {
  u64 ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// flags[parity][src][piece] of the channel at `base`.
__device__ __forceinline__ u64* flag_of(u64 base, int ep_size, int parity, int src, int piece) {
  return (u64*)base + ((i64)(parity * ep_size + src) * PEER_MAX_CHUNKS + piece);
}
__device__ __forceinline__ u64* acks_of(u64 base, int ep_size) {
  return (u64*)(base + 16ull * PEER_MAX_CHUNKS * ep_size);
}
__device__ __forceinline__ u64* step_of(u64 base, int ep_size) {
  return (u64*)(base + 16ull * PEER_MAX_CHUNKS * ep_size + 16ull * ep_size);
}
__device__ __forceinline__ u32* counters_of(u64 base, int ep_size) {
  return (u32*)(base + 16ull * PEER_MAX_CHUNKS * ep_size + 16ull * ep_size + 8ull);
}

// The slot index source `src` writes on destination `dst` (src != dst).
__device__ __forceinline__ int slot_of(int src, int dst) { return src < dst ? src : src - 1; }

// A load with acquire semantics at system scope: what the storing GPU wrote
// before its release (fence, then this word) is visible to loads after it.
__device__ __forceinline__ u64 load_acquire(const u64* word) {
  u64 value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}
__device__ __forceinline__ u32 load_acquire(const u32* word) {  // a counter of this GPU
  u32 value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(word) : "memory");
  return value;
}

// Waits until *word >= target (read with acquire semantics). Returns 0 when
// it is, 1 when this device has already failed (no wait), 2 on timeout. The deadline is wall time from
// %globaltimer (clock64 ticks at the SM clock, which moves between ~0.3 and
// ~2 GHz); a clock64 bound of 2 cycles per nanosecond backs it up in case the
// global timer does not advance.
template <typename Word>
__device__ int wait_at_least(const Word* word, Word target, const volatile u32* failed,
                             u64 timeout_ns, u64* waited_ns) {
  if (load_acquire(word) >= target) return 0;
  const u64 start_ns = global_ns();
  const long long start_cycles = clock64();
  const long long max_cycles = (long long)(2 * timeout_ns);
  unsigned backoff_ns = 32;
  while (true) {
    // Backs off between polls: many waiters hammering one L2 line slow down
    // the stores they are waiting for.
    __nanosleep(backoff_ns);
    backoff_ns = backoff_ns < 512 ? 2 * backoff_ns : 512;
    if (load_acquire(word) >= target) return 0;
    if (*failed != 0u) return 1;
    const u64 waited = global_ns() - start_ns;
    if (waited > timeout_ns || clock64() - start_cycles > max_cycles) {
      *waited_ns = waited;
      return 2;
    }
  }
}

__device__ void record_timeout(u32* failed, PeerFailure* record, u32 kind, int peer, int site,
                               int rank, u64 step, u64 waited_ns) {
  if (atomicCAS(failed, 0u, 1u) != 0u) return;  // the first failure of the device wins
  volatile PeerFailure* out = record;
  out->peer = (u32)peer;
  out->site = (u32)site;
  out->rank = (u32)rank;
  out->step = step;
  out->waited_ns = waited_ns;
  __threadfence_system();
  out->kind = kind;  // last: the host reads kind first
  __threadfence_system();
}

// One thread waits for *word >= target, or records the timeout. The wait's
// acquire load orders this thread's later loads after the peer's stores
// before its flag; the caller's barrier (__syncthreads, __syncwarp) extends
// that to the threads it syncs.
__device__ __forceinline__ void thread_wait(const u64* word, u64 target, u32* failed,
                                            PeerFailure* record, u64 timeout_ns, u32 kind,
                                            int peer, int site, int rank, u64 step) {
  u64 waited_ns = 0;
  if (wait_at_least(word, target, failed, timeout_ns, &waited_ns) == 2)
    record_timeout(failed, record, kind, peer, site, rank, step, waited_ns);
}

// Thread 0 waits for *word >= target (or records the timeout); then the block.
__device__ __forceinline__ void block_wait(const u64* word, u64 target, u32* failed,
                                           PeerFailure* record, u64 timeout_ns, u32 kind,
                                           int peer, int site, int rank, u64 step) {
  if (threadIdx.x == 0)
    thread_wait(word, target, failed, record, timeout_ns, kind, peer, site, rank, step);
  __syncthreads();
}

// The end of a block that stored part of this device's chunk for `dest`:
// once all blocks_per_peer blocks for dest have, raises dest's flag to step.
__device__ __forceinline__ void chunk_sent(u64 own, u64 peer, int rank, int ep_size, int dest,
                                           int parity, u64 step, int blocks_per_peer) {
  __threadfence_system();  // this thread's stores reach the peer before the count
  __syncthreads();
  if (threadIdx.x == 0) {
    u32* send_done = counters_of(own, ep_size);
    if (atomicAdd(send_done + dest, 1u) == (u32)(blocks_per_peer - 1)) {
      send_done[dest] = 0u;  // every block for dest has counted: rearm for the next launch
      __threadfence_system();
      atomicExch(flag_of(peer, ep_size, parity, rank, 0), step);
    }
  }
}

// The end of a block that read part of src's chunk: once all blocks_per_peer
// blocks for src have, acknowledges step to src; once every source is
// acknowledged, advances this device's step counter (if advance_step).
__device__ __forceinline__ void chunk_read(u64 own, const u64* peers, int rank, int ep_size,
                                           int src, int parity, u64 step, int blocks_per_peer,
                                           bool advance_step) {
  __syncthreads();  // every load of this block's part has returned
  if (threadIdx.x == 0) {
    u32* counters = counters_of(own, ep_size);
    u32* recv_done = counters + ep_size;
    __threadfence();
    if (atomicAdd(recv_done + src, 1u) == (u32)(blocks_per_peer - 1)) {
      recv_done[src] = 0u;
      __threadfence_system();
      atomicExch(acks_of(peers[src], ep_size) + parity * ep_size + rank, step);
      if (!advance_step) return;
      u32* recv_sources = counters + 2 * ep_size;
      if (atomicAdd(recv_sources, 1u) == (u32)(ep_size - 2)) {
        *recv_sources = 0u;  // all sources done: every block has read the step
        *(volatile u64*)step_of(own, ep_size) = step;
      }
    }
  }
}

// Called by every block of a launch at its end: true in thread 0 of the last
// block to get there (every block has then counted itself), once per launch,
// with the counter rearmed for the next launch.
__device__ __forceinline__ bool last_block_of_launch(u64 own, int ep_size) {
  __syncthreads();  // every load and store of this block has been issued and returned
  if (threadIdx.x != 0) return false;
  u32* blocks_done = counters_of(own, ep_size) + 2 * ep_size + 1;
  __threadfence();
  if (atomicAdd(blocks_done, 1u) != gridDim.x - 1) return false;
  *blocks_done = 0u;
  return true;
}

// dst[i] = src[i] for i in [begin, end): loads UNROLL vectors per thread,
// then stores them. `from_peer_buffer` reads through L2 only (the data was
// stored by another GPU; L1 may hold a previous step's lines).
template <typename Vec, bool kFromPeerBuffer>
__device__ __forceinline__ void copy_range(const Vec* __restrict__ src, Vec* __restrict__ dst,
                                           i64 begin, i64 end) {
  const i64 stride = (i64)blockDim.x * PEER_UNROLL;
  for (i64 base = begin + threadIdx.x; base < end; base += stride) {
    Vec values[PEER_UNROLL];
#pragma unroll
    for (int u = 0; u < PEER_UNROLL; ++u) {
      const i64 i = base + (i64)u * blockDim.x;
      if (i < end) {
        if constexpr (kFromPeerBuffer) values[u] = __ldcg(src + i);
        else values[u] = src[i];
      }
    }
#pragma unroll
    for (int u = 0; u < PEER_UNROLL; ++u) {
      const i64 i = base + (i64)u * blockDim.x;
      if (i < end) dst[i] = values[u];
    }
  }
}

// The part-th of `parts` equal ranges of [0, n).
__device__ __forceinline__ void part_range(i64 n, int part, int parts, i64* begin, i64* end) {
  const i64 per = (n + parts - 1) / parts;
  *begin = per * part < n ? per * part : n;
  *end = *begin + per < n ? *begin + per : n;
}

// ---------------------------------------------------------------------------
// peer_send (block `block` of its grid): pushes x[d] into rank d's parity-p
// slot for every d != rank, raises d's flag; copies x[rank] to out[rank] (the
// local chunk).
//   grid:   (ep_size - 1) * blocks_per_peer + local_blocks blocks. Block b <
//           (ep_size - 1) * blocks_per_peer sends part b % blocks_per_peer of
//           the chunk for the (b / blocks_per_peer)-th other rank; later blocks
//           copy parts of the local chunk. block: any multiple of 32 threads.
//   inputs: x [ep_size, chunk_vecs] VEC; peers [ep_size] u64 channel bases.
//   output: out [ep_size, chunk_vecs] VEC, only chunk `rank` written here.
//   waits:  before overwriting d's parity-p slot, for acks[p][d] >= s - 2
//           (d has read that slot's previous use), bounded by timeout_ns.
//   bounds: returns unless 2 <= ep_size, 0 <= rank < ep_size, blocks_per_peer
//           >= 1 and b inside the grid above; every copy index is clipped to
//           [0, chunk_vecs).
// ---------------------------------------------------------------------------
template <typename Vec>
__device__ __forceinline__ void peer_send(const Vec* __restrict__ x, Vec* __restrict__ out,
                                          const u64* __restrict__ peers, int rank, int ep_size,
                                          i64 chunk_vecs, i64 slot_bytes, i64 data_offset,
                                          int blocks_per_peer, int local_blocks, u32* failed,
                                          PeerFailure* record, u64 timeout_ns, int site,
                                          int block) {
  if (ep_size < 2 || rank < 0 || rank >= ep_size || blocks_per_peer < 1 || local_blocks < 0)
    return;
  const int remote_blocks = (ep_size - 1) * blocks_per_peer;
  if (block >= remote_blocks + local_blocks) return;
  i64 begin, end;
  if (block >= remote_blocks) {
    part_range(chunk_vecs, block - remote_blocks, local_blocks, &begin, &end);
    copy_range<Vec, false>(x + rank * chunk_vecs, out + rank * chunk_vecs, begin, end);
    return;
  }
  const int nth = block / blocks_per_peer;
  const int dest = nth < rank ? nth : nth + 1;
  const u64 own = peers[rank];
  const u64 step = *(volatile u64*)step_of(own, ep_size) + 1;
  const int parity = (int)(step & 1ull);
  if (step > 2)
    block_wait(acks_of(own, ep_size) + parity * ep_size + dest, step - 2, failed, record,
               timeout_ns, PEER_WAIT_ACK, dest, site, rank, step - 2);
  const u64 peer = peers[dest];
  Vec* slot = (Vec*)(peer + data_offset +
                     (u64)(parity * (ep_size - 1) + slot_of(rank, dest)) * slot_bytes);
  part_range(chunk_vecs, block % blocks_per_peer, blocks_per_peer, &begin, &end);
  copy_range<Vec, false>(x + dest * chunk_vecs, slot, begin, end);
  chunk_sent(own, peer, rank, ep_size, dest, parity, step, blocks_per_peer);
}

// ---------------------------------------------------------------------------
// peer_recv (block `block` of its grid): waits for each other rank's chunk,
// copies it to out[src], acknowledges it to src; with advance_step the last
// block advances the step.
//   grid:   (ep_size - 1) * blocks_per_peer blocks; block b copies part
//           b % blocks_per_peer of the (b / blocks_per_peer)-th other rank's
//           chunk. block: any multiple of 32 threads.
//   inputs: peers [ep_size] u64 channel bases (this device's own slots hold
//           the chunks).
//   output: out [ep_size, chunk_vecs] VEC, every chunk but `rank`.
//   waits:  for flags[p][src] >= s, bounded by timeout_ns.
//   bounds: as peer_send.
// ---------------------------------------------------------------------------
template <typename Vec, bool kCopy = true>
__device__ __forceinline__ void peer_recv(Vec* __restrict__ out, const u64* __restrict__ peers,
                                          int rank, int ep_size, i64 chunk_vecs, i64 slot_bytes,
                                          i64 data_offset, int blocks_per_peer, u32* failed,
                                          PeerFailure* record, u64 timeout_ns, int site,
                                          int block, bool advance_step) {
  if (ep_size < 2 || rank < 0 || rank >= ep_size || blocks_per_peer < 1) return;
  if (block >= (ep_size - 1) * blocks_per_peer) return;
  const int nth = block / blocks_per_peer;
  const int src = nth < rank ? nth : nth + 1;
  const u64 own = peers[rank];
  const u64 step = *(volatile u64*)step_of(own, ep_size) + 1;
  const int parity = (int)(step & 1ull);
  block_wait(flag_of(own, ep_size, parity, src, 0), step, failed, record, timeout_ns,
             PEER_WAIT_FLAG, src, site, rank, step);
  const Vec* slot = (const Vec*)(own + data_offset +
                                 (u64)(parity * (ep_size - 1) + nth) * slot_bytes);
  i64 begin, end;
  part_range(chunk_vecs, block % blocks_per_peer, blocks_per_peer, &begin, &end);
  if constexpr (kCopy) copy_range<Vec, true>(slot, out + src * chunk_vecs, begin, end);
  chunk_read(own, peers, rank, ep_size, src, parity, step, blocks_per_peer, advance_step);
}

// ---------------------------------------------------------------------------
// peer_exchange_v{16,8,4,2,1}: peer_send then peer_recv in one launch (the
// drop-in exchange: no second launch, the receive blocks already waiting
// while the sends run). Blocks [0, send_grid) are peer_send's grid
// ((ep_size - 1) * blocks_per_peer + local_blocks), the rest peer_recv's.
// The step advances once every block of the launch is done (not when every
// source is read, as in peer_recv): a block scheduled late still reads this
// exchange's step. Inputs, output, waits and bounds: as the two kernels.
// ---------------------------------------------------------------------------
template <typename Vec>
__device__ __forceinline__ void peer_exchange(const Vec* __restrict__ x, Vec* __restrict__ out,
                                              const u64* __restrict__ peers, int rank,
                                              int ep_size, i64 chunk_vecs, i64 slot_bytes,
                                              i64 data_offset, int blocks_per_peer,
                                              int local_blocks, u32* failed, PeerFailure* record,
                                              u64 timeout_ns, int site) {
  if (ep_size < 2 || rank < 0 || rank >= ep_size || blocks_per_peer < 1 || local_blocks < 0)
    return;
  const u64 own = peers[rank];
  const u64 step = *(volatile u64*)step_of(own, ep_size) + 1;
  const int send_grid = (ep_size - 1) * blocks_per_peer + local_blocks;
  if ((int)blockIdx.x < send_grid)
    peer_send<Vec>(x, out, peers, rank, ep_size, chunk_vecs, slot_bytes, data_offset,
                   blocks_per_peer, local_blocks, failed, record, timeout_ns, site, blockIdx.x);
  else
    peer_recv<Vec>(out, peers, rank, ep_size, chunk_vecs, slot_bytes, data_offset,
                   blocks_per_peer, failed, record, timeout_ns, site, blockIdx.x - send_grid,
                   false);
  if (last_block_of_launch(own, ep_size)) *(volatile u64*)step_of(own, ep_size) = step;
}

#define DEFINE_PEER_KERNELS(SUFFIX, VEC)                                                        \
  extern "C" __global__ void peer_exchange_##SUFFIX(                                            \
      const VEC* x, VEC* out, const u64* peers, int rank, int ep_size, i64 chunk_vecs,          \
      i64 slot_bytes, i64 data_offset, int blocks_per_peer, int local_blocks, u32* failed,     \
      PeerFailure* record, u64 timeout_ns, int site) {                                          \
    peer_exchange<VEC>(x, out, peers, rank, ep_size, chunk_vecs, slot_bytes, data_offset,       \
                       blocks_per_peer, local_blocks, failed, record, timeout_ns, site);        \
  }

DEFINE_PEER_KERNELS(v16, uint4)
DEFINE_PEER_KERNELS(v8, uint2)
DEFINE_PEER_KERNELS(v4, unsigned int)
DEFINE_PEER_KERNELS(v2, unsigned short)
DEFINE_PEER_KERNELS(v1, unsigned char)


// peer_send_v16 then peer_drain_v16 (peer_recv without the copy: waits,
// acknowledges, advances the step) measure the peer-write ceiling: rows
// stored straight into the peers' slots, nothing copied out.
extern "C" __global__ void peer_send_v16(const uint4* x, uint4* out, const u64* peers, int rank,
                                         int ep_size, i64 chunk_vecs, i64 slot_bytes,
                                         i64 data_offset, int blocks_per_peer, int local_blocks,
                                         u32* failed, PeerFailure* record, u64 timeout_ns,
                                         int site) {
  peer_send<uint4>(x, out, peers, rank, ep_size, chunk_vecs, slot_bytes, data_offset,
                   blocks_per_peer, local_blocks, failed, record, timeout_ns, site, blockIdx.x);
}
extern "C" __global__ void peer_drain_v16(uint4* out, const u64* peers, int rank, int ep_size,
                                          i64 chunk_vecs, i64 slot_bytes, i64 data_offset,
                                          int blocks_per_peer, u32* failed, PeerFailure* record,
                                          u64 timeout_ns, int site) {
  peer_recv<uint4, false>(out, peers, rank, ep_size, chunk_vecs, slot_bytes, data_offset,
                          blocks_per_peer, failed, record, timeout_ns, site, blockIdx.x, true);
}

// ===========================================================================
// Fused row paths of dispatch and combine (the peer branches of
// _rows_to_slabs / _slabs_to_rows in moe_ep/transport/__init__.py). Same
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
// slab layout in the same launch (LayoutJob above): route's outputs in,
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
// own-first pass (sharing one body behind a flag made P2's combine 35%
// slower in the loopback on one H200).
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
