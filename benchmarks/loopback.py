"""P2's fused peer row kernels on ONE GPU (:mod:`benchmarks.peer_loopback`):
rank 0's dispatch (bf16 rows, FP8 wire rows) and combine at EP=R, every
rank's channel in this GPU's memory and every flag raised, so a launch
times the kernel's own memory work with no NVLink and no waiting: what
the row movement costs a GPU, and FP8's speed-up there, apart from the link.
The timed launches repeat a full loopback exchange (every rank's kernel run
in turn): ``same_as_full_exchange`` checks the last one's output against it.

Decode (``decode_concurrent``): every rank's kernels at once on this GPU,
each rank a 1/R share of its SMs (:func:`_decode_concurrent`).

Routing: P2's (:func:`~benchmarks.ep_inputs.uniform_routing`), its handle from the
pure-JAX layout on R CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``). Dispatch's bytes
per launch (``hbm_bytes``): the HBM traffic it must do, from the handle:
token rows read, wire rows stored for the other ranks and read back from
theirs, every slab row written (kept rows and, bf16 only, zeroed padding;
FP8 slabs' padding is left unwritten).
"""

from __future__ import annotations

import jax
import numpy as np

from benchmarks.ep_inputs import per_rank, routing_only, sharded_routing, uniform_routing
from moe_ep.transport import expert_capacity_for, kernel_launch, send_capacity_for
from moe_ep.transport import xla as xla_backend
from moe_ep.transport.launch_geometry import SlabSizes
from moe_ep.transport.plan import plan_dispatch
from moe_ep.transport.peer import channel, dispatch_layout, fused_layout, kernels
from benchmarks import peer_loopback
from moe_ep.transport.peer import rows as peer_rows

FP8 = "float8_e4m3fn"


def _handle(ep_size: int, tokens: int, num_experts: int, hidden: int, top_k: int,
            capacity_factor) -> tuple:
  """Every rank's routing handle of bf16 rows of ``hidden`` (pure JAX on R
  CPU devices), and the capacities."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:ep_size]), ("ep",))
  capacity = expert_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  send_capacity = send_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  idx, weights = sharded_routing(mesh, tokens, top_k, num_experts, tokens + num_experts)
  plan = plan_dispatch(num_experts=num_experts, ep_size=ep_size, expert_capacity=capacity,
                       send_capacity=send_capacity, top_k=top_k, hidden=hidden,
                       row_dtype="bfloat16", axis_name="ep", transport="xla",
                       exchange="all_to_all", mesh=mesh)
  routing = routing_only(plan)

  maps = jax.jit(per_rank(mesh, lambda idx, weights: routing(idx, weights)._asdict()))(
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


# Decode chains timed with every rank at once: each a sequence of parts per
# step. "layout": the metadata exchange fused with the slab layout;
# "dispatch": peer_dispatch (reading the maps the layout gives);
# "one_launch": peer_dispatch_layout; "combine": peer_combine (at decode
# sizes its receivers sum the own members before waiting: own_first);
# "combine_in_order": peer_combine waiting first, as at larger sizes.
DECODE_CHAINS = {
    "layout": ("layout",), "dispatch": ("dispatch",), "combine": ("combine",),
    "two_launches": ("layout", "dispatch"), "one_launch": ("one_launch",),
    "two_launches_and_combine": ("layout", "dispatch", "combine"),
    "one_launch_and_combine": ("one_launch", "combine"),
    "combine_in_order": ("combine_in_order",),
    "two_launches_and_combine_in_order": ("layout", "dispatch", "combine_in_order"),
}


def _decode_concurrent(ep_size: int, tokens: int, num_experts: int, hidden: int, top_k: int,
                       capacity_factor, steps: int, chains: dict = DECODE_CHAINS,
                       rounds: int = 2) -> dict:
  """Decode's peer kernels with every rank running at once on this GPU
  (:func:`peer_loopback.time_concurrently`, a 1/R share of the SMs each),
  time per step of each chain in ``chains`` (:data:`DECODE_CHAINS`),
  alternated ``rounds`` times: the default path (the metadata exchange
  fused with the slab layout, then ``peer_dispatch``) against
  ``peer_dispatch_layout`` (the one-launch dispatch, off by default), with
  and without the combine, and each part alone. ``peer_dispatch`` and the
  combine read maps the pure-JAX layout computed (the values the fused
  layouts write)."""
  import cupy
  local = num_experts // ep_size
  capacity = expert_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  send_capacity = send_capacity_for(tokens, top_k, num_experts, ep_size, capacity_factor)
  sizes = (send_capacity, top_k, local, capacity)
  case = {"ep_size": ep_size, "tokens_per_rank": tokens, "num_experts": num_experts,
          "hidden": hidden, "expert_capacity": capacity, "send_capacity": send_capacity,
          "steps_per_graph": steps}
  if not (fused_layout.fused_layout_fits(SlabSizes(ep_size, *sizes))
          and dispatch_layout.dispatch_layout_fits("bfloat16", hidden, SlabSizes(ep_size, *sizes))):
    case["skipped"] = "the fused layout or the one-launch dispatch does not take this shape"
    return case
  rng = np.random.default_rng(tokens + num_experts + ep_size)
  with jax.default_device(jax.devices("cpu")[0]):
    routes = [[np.asarray(a) for a in xla_backend.route(
        *uniform_routing(rng, tokens, top_k, num_experts), num_experts=num_experts,
        ep_size=ep_size, send_capacity=send_capacity)] for _ in range(ep_size)]
    maps = [[np.asarray(a) for a in xla_backend.slab_layout(
        np.stack([r[3][q] for r in routes]), top_k=top_k, num_local_experts=local,
        expert_capacity=capacity)] for q in range(ep_size)]
  slab_rows = local * capacity
  put = lambda a: cupy.asarray(np.ascontiguousarray(a))  # noqa: E731
  ranks = [dict(rows=_bf16_bits(q, (tokens, hidden)), send_slot=put(routes[q][0]),
                send_token=put(routes[q][1].reshape(-1)), meta=put(routes[q][3]),
                recv_pos=put(maps[q][0].reshape(-1)), slab_row=put(maps[q][1].reshape(-1)),
                expert_rows=_bf16_bits(10 + q, (slab_rows, hidden))) for q in range(ep_size)]
  dispatch = peer_rows.dispatch_kernel("bfloat16", tokens, hidden, send_capacity, top_k, slab_rows)
  combine = peer_rows.combine_kernel("bfloat16", tokens, hidden, send_capacity, top_k, slab_rows,
                                     ep_size=ep_size)
  in_order = peer_rows.combine_kernel("bfloat16", tokens, hidden, send_capacity, top_k,
                                      slab_rows, ep_size=ep_size, own_first=False)
  one = dispatch_layout.dispatch_layout_kernel("bfloat16", tokens, hidden, *sizes)
  layout = dispatch.layout(ep_size)
  meta_layout = channel.meta_channel_layout(ep_size, ranks[0]["meta"].shape[1])
  share = kernels.multiprocessors(0) // ep_size
  grids = {k: k.grid(ep_size, share) for k in (dispatch, combine, one)}
  case["grids"] = {k.function: g.__dict__ for k, g in grids.items()}
  case["combine_kernel"] = combine.function
  shapes = dispatch_layout.dispatch_layout_shapes(one, ep_size, np.uint16, hidden)
  fresh = lambda specs: [peer_loopback._unwritten(cupy, s.shape, s.dtype)  # noqa: E731
                         for s in specs]

  def part(name, q, peers, tail):
    r = ranks[q]
    if name == "layout":
      outs = fresh(shapes[1:6])
      return (fused_layout.slab_layout_kernel(meta_layout, 0, peers[1], q, sizes, tail),
              (r["meta"], *outs), outs)
    if name == "dispatch":
      return peer_loopback.row_job(
          dispatch, grids[dispatch], layout, peers[0], q, tail,
          (r["rows"], r["send_token"], r["send_slot"], r["recv_pos"], r["slab_row"]),
          (slab_rows, hidden), np.uint16)
    if name == "one_launch":
      outs = fresh(shapes)
      job = dispatch_layout.dispatch_layout_launch(one, grids[one], layout, meta_layout, 0,
                                                   peers[0], peers[1], q, tail)
      return job, (r["rows"], r["send_token"], r["send_slot"], r["meta"], *outs), outs
    kernel = in_order if name == "combine_in_order" else combine
    return peer_loopback.row_job(
        kernel, grids[combine], layout, peers[0], q, tail,
        (r["expert_rows"], r["recv_pos"].reshape(-1, top_k), r["send_slot"]),
        (tokens, hidden), np.uint16)

  for _ in range(rounds):
    for name, parts in chains.items():
      case.setdefault(name, []).append(peer_loopback.time_concurrently(
          [layout, meta_layout],
          lambda step, q, peers, tail, parts=parts: [part(p, q, peers, tail) for p in parts],
          steps=steps))
  return case


def run(ep_sizes=(2, 4, 8), tokens=8192, num_experts=64, hidden=7168, top_k=8,
        capacity_factor=1.25, iters=30, decode_cases=((2, 128), (4, 32)), decode_experts=256,
        decode_steps=20) -> dict:
  result = {"tokens_per_rank": tokens, "num_experts": num_experts, "hidden": hidden,
            "top_k": top_k, "capacity_factor": capacity_factor, "cases": []}
  if not kernel_launch.cupy_available() or jax.devices()[0].platform != "gpu":
    result["skipped"] = "needs a CUDA GPU and CuPy"
    return result
  for ep_size in ep_sizes:
    if ep_size > len(jax.devices("cpu")):
      result["cases"].append({"ep_size": ep_size, "skipped": (
          f"the routing runs on {ep_size} CPU devices: set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={ep_size}")})
      continue
    ranks, capacity, send_capacity = _handle(ep_size, tokens, num_experts, hidden, top_k,
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
      kernel = peer_rows.dispatch_kernel("bfloat16", tokens, hidden, send_capacity, top_k,
                                         slab_rows, wire_dtype)
      width = kernel.row_vecs * 16
      inputs = [(rows[r], *maps[r]) for r in range(ep_size)]
      full, launch = peer_loopback.run_rank(kernel, inputs, (slab_rows, width), np.uint8,
                                            rank=0, keep=True)
      timing = _timed(launch, iters)
      again = launch.out.get()
      # bf16: every slab row written (padding zeroed); FP8: the filled ones
      written = case["kept_slab_rows"] if wire_dtype else slab_rows
      hbm = read * hidden * 2 + (sent + received + written) * width
      case[name] = {**timing, "row_bytes": width, "grid": launch.grid.__dict__,
                    "same_as_full_exchange": bool(np.array_equal(full, again)),
                    "hbm_bytes": hbm, "hbm_tbs": hbm / timing["us"] / 1e6}
    case["dispatch_fp8"]["speedup_vs_bf16"] = case["dispatch"]["us"] / case["dispatch_fp8"]["us"]
    kernel = peer_rows.combine_kernel("bfloat16", tokens, hidden, send_capacity, top_k,
                                      slab_rows, ep_size=ep_size)
    slabs = [_bf16_bits(10 + r, (slab_rows, hidden)) for r in range(ep_size)]
    inputs = [(slabs[r], maps[r][2].reshape(-1, top_k), ranks[r]["send_slot"])
              for r in range(ep_size)]
    full, launch = peer_loopback.run_rank(kernel, inputs, (tokens, hidden), np.uint16, rank=0,
                                          keep=True)
    case["combine"] = {**_timed(launch, iters), "grid": launch.grid.__dict__,
                       "same_as_full_exchange": bool(np.array_equal(full, launch.out.get()))}
    result["cases"].append(case)
  result["decode_concurrent"] = [
      _decode_concurrent(r, decode_tokens, decode_experts, hidden, top_k, capacity_factor,
                         decode_steps) for r, decode_tokens in decode_cases]
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
  for case in result.get("decode_concurrent", []):
    if "skipped" in case:
      lines.append(f"  decode EP={case['ep_size']}: skipped ({case['skipped']})")
      continue
    timed = {k: "/".join(f"{t['us']:.1f}" for t in case[k]) for k in DECODE_CHAINS
             if k in case}
    lines.append(f"  decode EP={case['ep_size']}, ranks at once, us per step: " +
                 ", ".join(f"{k} {v}" for k, v in timed.items()))
  return "\n".join(lines)
