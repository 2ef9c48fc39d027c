// The peer exchange's protocol, included by every peer_*.cu (docs/peer.md
// walks through it). Direct peer exchange: the all_to_all of one [R, chunk]
// buffer over the EP group, done by storing each chunk straight into the
// destination GPU's memory (NVLink peer access in one process, CUDA IPC
// mappings across processes).
//
// Each device holds one "channel" allocation per (group, chunk size), written
// by its peers; `peers[r]` is rank r's allocation as mapped on this device
// (`peers[rank]` is this device's own). Byte offsets inside one allocation,
// with R = ep_size and M = PEER_MAX_CHUNKS (moe_ep/transport/peer/channel.py's
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
// or a fused row kernel (peer_dispatch.cu, peer_combine.cu: peer_dispatch,
// peer_combine_*: the same protocol, rows moved straight between dispatch's
// and combine's XLA buffers and the slots, sender and receiver blocks in one
// grid). Every kernel reads s = step + 1 and parity p = s & 1; the last block
// of the exchange to finish stores step = s, so every launch has the same
// arguments (CUDA-graph replayable) and the counters agree because every rank
// runs the same sequence of exchanges.
// Every spin-wait is bounded: on timeout the first waiter of the device sets
// `failed` and writes a PeerFailure into host-mapped memory; later waits on
// the device return at once (the results are then garbage, and Python raises).

#ifndef MOE_EP_PEER_CUH
#define MOE_EP_PEER_CUH

#include "common.cuh"

#define PEER_UNROLL 4
#define PEER_MAX_CHUNKS 1024  // flags per (parity, source): chunks of one fused exchange

// What a timed-out wait was waiting for (PeerFailure::kind).
#define PEER_WAIT_ACK 1   // sender: for the peer to acknowledge step - 2
#define PEER_WAIT_FLAG 2  // receiver: for the peer's chunk of this step
#define PEER_WAIT_LAYOUT 3  // peer_dispatch_layout's receivers: for each other's slab maps

typedef unsigned long long u64;

struct PeerFailure {  // 32 bytes, mirrored by peer/failures.py's Failure
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

#endif  // MOE_EP_PEER_CUH
