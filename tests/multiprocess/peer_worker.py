"""One process of the two-process peer-exchange test (one GPU each); started
by ``moe_ep.launch --gpus-per-process 1`` from tests/transport/test_peer.py.

    python -m moe_ep.launch --num-processes 2 --gpus-per-process 1 -- \\
        python tests/multiprocess/peer_worker.py

Checks, over the global 1 x R mesh: (1) ``peer.exchange`` in a 50-step scan
over fresh data equals the host-computed all_to_all bitwise (buffers
addressed through CUDA IPC handles from the key-value store); (2) when only
process 0 runs an exchange, its wait times out within the short bound and
the error names rank 1 and the step. Prints one ``PEER_RESULT {json}`` line.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep.distributed import initialize_from_env

STEPS, ROWS, HIDDEN = 50, 96, 200  # 200 bf16 = 400 B rows: 16-byte vectors
TIMEOUT_S = 1.0


def global_array(mesh, host, spec=P(None, "ep")):
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                      lambda index: host[index])


def expected_all_to_all(host: np.ndarray, ep: int) -> np.ndarray:
  """``[steps, R * R * k, ...]`` global input -> the all_to_all result, by
  the definition: rank r's output chunk src is rank src's input chunk r."""
  steps, total = host.shape[:2]
  per_rank = total // ep
  chunks = host.reshape(steps, ep, ep, per_rank // ep, *host.shape[2:])  # [s, rank, dest, k]
  return chunks.swapaxes(1, 2).reshape(host.shape)


def main() -> int:
  initialize_from_env()
  import jax.numpy as jnp
  from moe_ep.transport import peer

  ep = jax.device_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
  result = {"process": jax.process_index(), "supported": peer.supported(mesh, "ep"),
            "reason": peer.unsupported_reason(mesh, "ep")}
  rng = np.random.default_rng(0)
  host = rng.standard_normal((STEPS, ep * ep * ROWS, HIDDEN)).astype(jnp.bfloat16)

  def scan_body(_, x):
    return None, peer.exchange(x, "ep", mesh, "exchange_rows")

  fn = jax.jit(jax.shard_map(lambda xs: jax.lax.scan(scan_body, None, xs)[1], mesh=mesh,
                             in_specs=P(None, "ep"), out_specs=P(None, "ep")))
  got = fn(global_array(mesh, host))
  want = expected_all_to_all(host, ep)
  result["scan_equal"] = all(
      np.array_equal(np.asarray(shard.data).view(np.uint16),
                     want[shard.index].view(np.uint16)) for shard in got.addressable_shards)
  peer.raise_if_failed()
  result["buffer_bytes"] = peer.buffer_bytes()

  # Only process 0 runs this exchange; process 1 traces it (publishing its
  # buffer) and waits at the barrier.
  peer.configure(timeout_s=TIMEOUT_S)
  skip = jax.jit(jax.shard_map(lambda x: peer.exchange(x, "ep", mesh, "exchange_meta"),
                               mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  small = global_array(mesh, np.arange(ep * ep * 8 * 3, dtype=np.int32).reshape(-1, 3), P("ep"))
  compiled = skip.lower(small).compile()
  if jax.process_index() == 0:
    start = time.perf_counter()
    jax.block_until_ready(compiled(small))
    result["skip_seconds"] = time.perf_counter() - start
    try:
      peer.raise_if_failed()
      result["skip_error"] = None
    except peer.PeerTimeoutError as error:
      result["skip_error"] = {"message": str(error), "peer_rank": error.peer_rank,
                              "rank": error.rank, "step": error.step, "what": error.what}
  from jax._src import distributed
  distributed.global_state.client.wait_at_barrier("peer_worker_done", 120_000)
  peer.reset()
  print("PEER_RESULT " + json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
