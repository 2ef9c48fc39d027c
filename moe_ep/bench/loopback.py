"""P2's fused peer row kernels on ONE GPU (:mod:`moe_ep.transport.peer_loopback`):
rank 0's dispatch (bf16 rows, FP8 wire rows) and combine at EP=R, every
rank's channel in this GPU's memory and every flag raised, so a launch
times the kernel's own memory work with no NVLink and no waiting: what
the row movement costs a GPU, and FP8's speed-up there, apart from the link.
The timed launches repeat a full loopback exchange (every rank's kernel run
in turn): ``same_as_full_exchange`` checks the last one's output against it.

Routing: P2's (``ep._host_routing``: uniform top-k), its handle from the
pure-JAX layout on R CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``). Dispatch's bytes
per launch (``hbm_bytes``): the HBM traffic it must do, from the handle:
token rows read, wire rows stored for the other ranks and read back from
theirs, every slab row written (kept rows and zeroed padding).
"""

from __future__ import annotations

import jax
import numpy as np

from moe_ep import transport
from moe_ep.bench import ep
from moe_ep.transport import expert_capacity_for, peer, send_capacity_for

FP8 = "float8_e4m3fn"


def _handle(ep_size: int, tokens: int, num_experts: int, top_k: int, capacity_factor) -> tuple:
  """Every rank's routing handle (pure JAX on R CPU devices), and the
  capacities."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:ep_size]), ("ep",))
  capacity = expert_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  send_capacity = send_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  rng = np.random.default_rng(tokens + num_experts)
  idx, weights = (ep._shard(mesh, a)
                  for a in ep._host_routing(rng, ep_size * tokens, top_k, num_experts))
  spec = transport._Spec(num_experts=num_experts, ep_size=ep_size, expert_capacity=capacity,
                         send_capacity=send_capacity, axis_name="ep", backend="xla",
                         exchange="all_to_all", mesh=mesh)
  routing = ep._routing_only(spec, num_experts)

  maps = jax.jit(ep._smap(mesh, lambda idx, weights: routing(idx, weights)._asdict()))(
      idx, weights)
  ranks = [{k: np.asarray(v.addressable_shards[r].data) for k, v in maps.items()}
           for r in range(ep_size)]
  return ranks, capacity, send_capacity


def _bf16_bits(seed: int, shape: tuple):
  """Normal values rounded down to bfloat16, as uint16 bits on the GPU."""
  import cupy
  values = cupy.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
  return (values.view(np.uint32) >> 16).astype(np.uint16)


def _timed(launch, iters: int) -> dict:
  import cupy
  launch.run()
  times = []
  for _ in range(iters):
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    launch.run()
    end.record()
    end.synchronize()
    times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
  return {"us": float(np.median(times)), "min_us": float(np.min(times))}


def run(ep_sizes=(2, 4, 8), tokens=8192, num_experts=64, hidden=7168, top_k=8,
        capacity_factor=1.25, iters=30) -> dict:
  from moe_ep.transport import cupy as cupy_backend
  from moe_ep.transport import peer_loopback
  result = {"tokens_per_rank": tokens, "num_experts": num_experts, "hidden": hidden,
            "top_k": top_k, "capacity_factor": capacity_factor, "cases": []}
  if not cupy_backend.cupy_available() or jax.devices()[0].platform != "gpu":
    result["skipped"] = "needs a CUDA GPU and CuPy"
    return result
  import cupy
  for ep_size in ep_sizes:
    if ep_size > len(jax.devices("cpu")):
      result["cases"].append({"ep_size": ep_size, "skipped": (
          f"the routing runs on {ep_size} CPU devices: set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={ep_size}")})
      continue
    ranks, capacity, send_capacity = _handle(ep_size, tokens, num_experts, top_k,
                                             capacity_factor)
    slab_rows = ranks[0]["slab_row"].size
    rows = [_bf16_bits(r, (tokens, hidden)) for r in range(ep_size)]
    maps = [(h["send_token"].reshape(-1), h["send_slot"], h["recv_pos"].reshape(-1),
             h["slab_row"].reshape(-1)) for h in ranks]
    own = ranks[0]
    read = int((own["send_slot"] >= 0).any(1).sum())  # token rows read
    sent = int((own["send_token"][1:] >= 0).sum())  # wire rows stored for other ranks
    received = int((own["recv_pos"][1:] >= 0).any(-1).sum())  # wire rows read back
    case = {"ep_size": ep_size, "expert_capacity": capacity, "send_capacity": send_capacity,
            "slab_rows": slab_rows, "kept_slab_rows": int((own["recv_pos"] >= 0).sum()),
            "rows_read_sent_received": [read, sent, received]}
    for name, wire_dtype in (("dispatch", None), ("dispatch_fp8", FP8)):
      kernel = peer.dispatch_kernel("bfloat16", tokens, hidden, send_capacity, top_k, slab_rows,
                                    wire_dtype)
      width = kernel.row_vecs * 16
      inputs = [(rows[r], *maps[r]) for r in range(ep_size)]
      full, launch = peer_loopback.run_rank(kernel, inputs, (slab_rows, width), np.uint8,
                                            rank=0, keep=True)
      timing = _timed(launch, iters)
      again = launch.out.get()
      hbm = read * hidden * 2 + (sent + received + slab_rows) * width  # every slab row written
      case[name] = {**timing, "row_bytes": width, "grid": launch.grid.__dict__,
                    "same_as_full_exchange": bool(np.array_equal(full, again)),
                    "hbm_bytes": hbm, "hbm_tbs": hbm / timing["us"] / 1e6}
    case["dispatch_fp8"]["speedup_vs_bf16"] = case["dispatch"]["us"] / case["dispatch_fp8"]["us"]
    kernel = peer.combine_kernel("bfloat16", tokens, hidden, send_capacity, top_k, slab_rows)
    slabs = [_bf16_bits(10 + r, (slab_rows, hidden)) for r in range(ep_size)]
    inputs = [(slabs[r], maps[r][2].reshape(-1, top_k), ranks[r]["send_slot"])
              for r in range(ep_size)]
    full, launch = peer_loopback.run_rank(kernel, inputs, (tokens, hidden), np.uint16, rank=0,
                                          keep=True)
    case["combine"] = {**_timed(launch, iters), "grid": launch.grid.__dict__,
                       "same_as_full_exchange": bool(np.array_equal(full, launch.out.get()))}
    result["cases"].append(case)
  return result


def summary(result: dict) -> str:
  if "skipped" in result:
    return f"loopback: skipped ({result['skipped']})"
  lines = [f"loopback (one GPU, rank 0, every flag raised) T={result['tokens_per_rank']} "
           f"E={result['num_experts']} H={result['hidden']}"]
  for case in result["cases"]:
    if "skipped" in case:
      lines.append(f"  EP={case['ep_size']}: skipped ({case['skipped']})")
      continue
    d, f, c = case["dispatch"], case["dispatch_fp8"], case["combine"]
    lines.append(f"  EP={case['ep_size']}: dispatch {d['us']:.1f} us ({d['hbm_tbs']:.2f} TB/s), "
                 f"FP8 {f['us']:.1f} us ({f['hbm_tbs']:.2f} TB/s, {f['speedup_vs_bf16']:.2f}x), "
                 f"combine {c['us']:.1f} us")
  return "\n".join(lines)
