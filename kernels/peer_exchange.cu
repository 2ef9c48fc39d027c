// The drop-in exchange's kernels (moe_ep/transport/peer/dropin.py):
// peer_exchange_v{16,8,4,2,1}, and peer_send_v16 / peer_drain_v16 for the
// peer-write ceiling the benchmarks measure. Their bodies and the protocol
// are peer.cuh's (included below).

#include "common.cuh"
#include "peer.cuh"

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
