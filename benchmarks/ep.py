"""P2: dispatch and combine across GPUs on both exchange paths, XLA's
``all_to_all`` and the direct peer path (:mod:`moe_ep.transport.peer`), with
the ceilings measured in the same run.

For each tokens-per-rank ``T`` and expert count ``E`` (EP over every device
of the job): dispatch (routing, metadata exchange and rows), the dispatch row
path alone (given the routing handle, like DeepEP's dispatch with a cached
handle) and combine, on each path, checked bitwise against each other; the
peer row paths with fewer blocks (SMs). For each ``T``: the raw
``all_to_all`` of the ``[R, S, H]`` send buffer, the drop-in peer exchange of
it, and the peer-write ceiling (rows stored straight into the peers' slots,
nothing copied). Decode: the dispatch + combine round trip for a few tokens
per rank.

Bandwidth per GPU, both directions at once: ``off_device_gbs`` = useful
bytes leaving a GPU (rows for other ranks, padding excluded) / time, and
``received_gbs`` = DeepEP's measure, bytes a GPU receives including its own
rank's rows / time (the busiest rank's bytes). Device time per operation:
``repeat`` operations chained in one jitted call, each one's input waiting
for the previous one's output, so the host's per-call cost is paid once.

Runs over every device of the job: one process with several GPUs, or one
process per GPU under ``python -m moe_ep.launch --gpus-per-process 1``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from benchmarks import common
from benchmarks.ep_inputs import ep_inputs, per_rank, random_rows, routing_only
from moe_ep.transport import combine, dispatch, fp8, peer, row_paths
from moe_ep.transport.plan import auto_exchange_reason
from moe_ep.transport.peer import rows as peer_rows

PATHS = ("all_to_all", "peer")
FP8 = "float8_e4m3fn"
# The name the FP8 dispatch's slabs take where it lands them as FP8 (as the layer's does).
FP8_CHECKPOINT_NAME = "moe.dispatch"


def _chained(fn, repeat: int):
  """``fn(x, *rest)`` ``repeat`` times in one program. An optimization
  barrier ties each call's ``x`` to the previous call's output (no copy, no
  arithmetic), so the calls run one after another; one element of each
  output is returned, so none is dead code."""
  def body(x, *rest):
    kept = []
    for _ in range(repeat):
      out = fn(x, *rest)
      x, out = jax.lax.optimization_barrier((x, out))
      kept.append(jax.tree.leaves(out)[0].reshape(-1)[:1].astype(jnp.float32))
    return jnp.concatenate(kept)
  return body


def _timed(mesh, fn, args, *, repeat: int, iters: int, same_shape: bool = False) -> dict:
  """Device time of one ``fn`` call: ``repeat`` chained calls per jitted
  call. ``same_shape``: ``fn(x)`` has ``x``'s shape and feeds the next call
  itself (a plain collective, which XLA would merge if its input repeated)."""
  if same_shape:
    def chain_body(x):
      for _ in range(repeat):
        x = fn(x)
      return x
  else:
    chain_body = _chained(fn, repeat)
  timing = common.time_ms(jax.jit(per_rank(mesh, chain_body)), *args, iters=iters)
  return {"ms": timing["median_ms"] / repeat, "chain": timing}


def _with_gbs(timing: dict, off_device_bytes: int, received_bytes: int | None) -> dict:
  timing["off_device_gbs"] = off_device_bytes / timing["ms"] / 1e6
  if received_bytes is not None:
    timing["received_gbs"] = received_bytes / timing["ms"] / 1e6
  return timing


def _same_bits(a, b) -> bool:
  """Shard by shard (works across processes): equal bit patterns."""
  def bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))
  return all(np.array_equal(bits(x.data), bits(y.data))
             for x, y in zip(a.addressable_shards, b.addressable_shards))


def _multiprocessors() -> int | None:
  return getattr(jax.local_devices()[0], "core_count", None)


def _row_counts(send_slot: np.ndarray) -> dict:
  """Rows per rank from the gathered ``send_slot [R, T, R]``: sent to other
  ranks (dispatch's off-device rows), received from other ranks (combine's
  off-device rows), received including its own (dispatch's DeepEP rows) and
  returned to it including its own (combine's DeepEP rows)."""
  sent = send_slot >= 0  # [src, t, dest]
  per_pair = sent.sum(axis=1)  # [src, dest]
  own = np.diag(per_pair)
  return {"dispatch_off_device": (per_pair.sum(1) - own).tolist(),
          "combine_off_device": (per_pair.sum(0) - own).tolist(),
          "dispatch_received": per_pair.sum(0).tolist(),
          "combine_received": per_pair.sum(1).tolist()}


class _Grid:
  """``peer.configure(row_blocks=..., send_blocks=...)`` for programs traced inside."""

  def __init__(self, row_blocks, send_blocks):
    self.row_blocks, self.send_blocks = row_blocks, send_blocks

  def __enter__(self):
    peer.configure(row_blocks=self.row_blocks, send_blocks=self.send_blocks)

  def __exit__(self, *exc):
    peer.configure()


def _grids(ep_size: int, tokens: int, send_capacity: int, hidden: int, top_k: int,
           num_slab_rows: int) -> dict:
  """The fused row kernels' grids as now configured for bf16 rows of
  ``hidden`` (dispatch and combine) and for the FP8 dispatch."""
  sms = _multiprocessors() or 1
  shape = ("bfloat16", tokens, hidden, send_capacity, top_k, num_slab_rows)
  kernels = {"dispatch": peer_rows.dispatch_kernel(*shape),
             "combine": peer_rows.combine_kernel(*shape, ep_size=ep_size),
             "dispatch_fp8": peer_rows.dispatch_kernel(*shape, wire_dtype=FP8)}
  return {name: dataclasses.asdict(kernel.grid(ep_size, sms)) for name, kernel in kernels.items()}


def case(mesh, tokens: int, hidden: int, num_experts: int, top_k: int, capacity_factor,
         backend: str, iters: int, repeat: int = 10, grids=(), with_fp8=False) -> dict:
  """Dispatch, dispatch rows and combine on each path at one shape; with
  ``with_fp8`` also the dispatch with FP8 wire rows (dequantize fused into
  the receive, and with named FP8 slabs as the layer runs it) and its rows
  alone, with the speed-up over bf16 (bytes: the FP8 wire rows)."""
  ep_size = mesh.shape["ep"]
  inputs = ep_inputs(mesh, tokens, hidden, num_experts, top_k, capacity_factor,
                     tokens + num_experts)
  capacity, send_capacity = inputs.expert_capacity, inputs.send_capacity
  x, idx, weights = inputs.dispatch_args
  row_bytes = hidden * 2
  wire_row_bytes = fp8.wire_bytes(hidden)
  num_slab_rows = num_experts // ep_size * capacity
  reason = auto_exchange_reason(backend, "ep", mesh.shape["ep"], mesh)
  result = {"tokens_per_rank": tokens, "num_experts": num_experts, "expert_capacity": capacity,
            "send_capacity": send_capacity, "peer_unsupported_reason": reason}
  reference = None
  for path in PATHS if reason is None else PATHS[:1]:
    exchange = dict(transport=backend, exchange=path, mesh=mesh)
    options = inputs.dispatch_options(backend, path)
    plan = inputs.plan(backend, path)

    def dispatch_fn(x, idx, weights):
      return dispatch(x, idx, weights, **options)

    def rows_fn(x, handle):
      return row_paths.rows_to_slabs(plan, x, handle)

    def combine_fn(slabs, handle):
      return combine(slabs, handle, num_tokens=tokens, axis_name="ep", **exchange)

    dispatched = jax.jit(per_rank(mesh, dispatch_fn))(x, idx, weights)
    y = jax.jit(per_rank(mesh, combine_fn))(dispatched.tokens, dispatched.handle)
    if reference is None:
      reference = dispatched.tokens, y
      send_slot = np.asarray(multihost_utils.process_allgather(dispatched.handle.send_slot,
                                                              tiled=True))
      rows = _row_counts(send_slot.reshape(ep_size, tokens, ep_size))
      result["rows_per_rank"] = rows
      nbytes = {k: max(v) * row_bytes for k, v in rows.items()}
      fp8_bytes = {k: max(v) * wire_row_bytes for k, v in rows.items()}
    timings = {}
    for name, fn, args, kind in (("dispatch", dispatch_fn, (x, idx, weights), "dispatch"),
                                 ("dispatch_rows", rows_fn, (x, dispatched.handle), "dispatch"),
                                 ("combine", combine_fn, (dispatched.tokens, dispatched.handle),
                                  "combine")):
      timings[name] = _with_gbs(_timed(mesh, fn, args, repeat=repeat, iters=iters),
                                nbytes[f"{kind}_off_device"], nbytes[f"{kind}_received"])
    timings["routing"] = _timed(mesh, routing_only(plan), (idx, weights),
                                repeat=repeat, iters=iters)
    timings["bitwise_equal_to_all_to_all"] = (_same_bits(dispatched.tokens, reference[0])
                                              and _same_bits(y, reference[1]))
    if with_fp8:
      # FP8 rows dequantized as they land, and FP8 slabs (what the named dispatch lands)
      fp8_plan = inputs.plan(backend, path, wire_dtype=FP8)
      fp8_slabs_plan = inputs.plan(backend, path, wire_dtype=FP8,
                                   checkpoint_name=FP8_CHECKPOINT_NAME)
      fp8_slabs = None
      for name, checkpoint_name in (("dispatch_fp8", None),
                                    ("dispatch_fp8_named", FP8_CHECKPOINT_NAME)):
        fn = lambda x, idx, weights, n=checkpoint_name: dispatch(
            x, idx, weights, **options, wire_dtype=FP8, checkpoint_name=n)
        slabs = jax.jit(per_rank(mesh, fn))(x, idx, weights).tokens
        fp8_slabs = slabs if fp8_slabs is None else fp8_slabs
        timings[name] = _with_gbs(_timed(mesh, fn, (x, idx, weights), repeat=repeat,
                                         iters=iters),
                                  fp8_bytes["dispatch_off_device"],
                                  fp8_bytes["dispatch_received"])
        timings[name]["speedup_vs_bf16"] = timings["dispatch"]["ms"] / timings[name]["ms"]
        timings[name]["same_slabs_as_fused"] = _same_bits(slabs, fp8_slabs)
      timings["dispatch_rows_fp8"] = _with_gbs(
          _timed(mesh, lambda x, h: row_paths.rows_to_slabs_fp8(fp8_plan, x, h),
                 (x, dispatched.handle), repeat=repeat, iters=iters),
          fp8_bytes["dispatch_off_device"], fp8_bytes["dispatch_received"])
      timings["dispatch_rows_fp8"]["speedup_vs_bf16"] = (
          timings["dispatch_rows"]["ms"] / timings["dispatch_rows_fp8"]["ms"])

      # What the layer's named FP8 dispatch produces and saves: the FP8 slabs
      # (codes and scales), dequantized row for row before the expert GEMM reads them.
      fp8_routing = routing_only(fp8_slabs_plan)

      def fp8_slabs_fn(x, idx, weights):
        return row_paths.rows_to_fp8_slabs(fp8_slabs_plan, x, fp8_routing(idx, weights))

      def fp8_slab_rows_fn(x, handle):
        return row_paths.rows_to_fp8_slabs(fp8_slabs_plan, x, handle)

      for name, fn, args, bf16 in (
          ("dispatch_fp8_slabs", fp8_slabs_fn, (x, idx, weights), "dispatch"),
          ("dispatch_rows_fp8_slabs", fp8_slab_rows_fn, (x, dispatched.handle),
           "dispatch_rows")):
        timings[name] = _with_gbs(_timed(mesh, fn, args, repeat=repeat, iters=iters),
                                  fp8_bytes["dispatch_off_device"],
                                  fp8_bytes["dispatch_received"])
        timings[name]["speedup_vs_bf16"] = timings[bf16]["ms"] / timings[name]["ms"]
      if path == PATHS[0]:
        result["fp8_reference"] = fp8_slabs
      timings["fp8_bitwise_equal_to_all_to_all"] = _same_bits(fp8_slabs,
                                                              result["fp8_reference"])
    if path == "peer":
      timings["default_grid"] = _grids(ep_size, tokens, send_capacity, hidden, top_k,
                                       num_slab_rows)
    if path == "peer" and grids:
      timings["grids"] = []
      for row_blocks, send_blocks in grids:
        with _Grid(row_blocks, send_blocks):
          timings["grids"].append({
              "requested": {"row_blocks": row_blocks, "send_blocks": send_blocks},
              "grid": _grids(ep_size, tokens, send_capacity, hidden, top_k, num_slab_rows),
              "dispatch_rows": _with_gbs(
                  _timed(mesh, rows_fn, (x, dispatched.handle), repeat=repeat, iters=iters),
                  nbytes["dispatch_off_device"], nbytes["dispatch_received"]),
              "combine": _with_gbs(
                  _timed(mesh, combine_fn, (dispatched.tokens, dispatched.handle),
                         repeat=repeat, iters=iters),
                  nbytes["combine_off_device"], nbytes["combine_received"])})
          if with_fp8:  # the FP8 dispatch's rows into FP8 slabs on the same grid
            timings["grids"][-1]["dispatch_rows_fp8_slabs"] = _with_gbs(
                _timed(mesh, fp8_slab_rows_fn, (x, dispatched.handle), repeat=repeat,
                       iters=iters),
                fp8_bytes["dispatch_off_device"], fp8_bytes["dispatch_received"])
    result[path] = timings
  result.pop("fp8_reference", None)
  return result


def raw_case(mesh, send_capacity: int, hidden: int, backend: str, iters: int,
             repeat: int = 10) -> dict:
  """The ``[R, S, H]`` send buffer moved whole: XLA's ``all_to_all``, the
  drop-in peer exchange, and the peer-write ceiling (stores into the peers'
  slots and the signal, no copy on either side)."""
  ep_size = mesh.shape["ep"]
  buffer = random_rows(mesh, ep_size * ep_size * send_capacity, hidden, send_capacity)
  chunk_bytes = send_capacity * hidden * 2
  off_device, received = (ep_size - 1) * chunk_bytes, ep_size * chunk_bytes
  result = {"shape_per_rank": [ep_size, send_capacity, hidden], "dtype": "bfloat16"}

  def all_to_all(b):
    return jax.lax.all_to_all(b, "ep", 0, 0, tiled=True)

  result["all_to_all"] = _with_gbs(_timed(mesh, all_to_all, (buffer,), repeat=repeat,
                                          iters=iters, same_shape=True), off_device, received)
  reason = auto_exchange_reason(backend, "ep", mesh.shape["ep"], mesh)
  result["peer_unsupported_reason"] = reason
  if reason is None:
    def exchange(b):
      return peer.exchange(b, "ep", mesh, "exchange_rows")

    def ceiling(b):
      return peer.write_ceiling(b, "ep", mesh)

    want = jax.jit(per_rank(mesh, all_to_all))(buffer)
    got = jax.jit(per_rank(mesh, exchange))(buffer)
    result["peer_exchange"] = _with_gbs(_timed(mesh, exchange, (buffer,), repeat=repeat,
                                               iters=iters, same_shape=True),
                                        off_device, received)
    result["peer_exchange"]["bitwise_equal_to_all_to_all"] = _same_bits(got, want)
    result["peer_write_ceiling"] = _with_gbs(_timed(mesh, ceiling, (buffer,), repeat=repeat,
                                                    iters=iters), off_device, None)
    peer.raise_if_failed()
  return result


def decode_case(mesh, tokens: int, hidden: int, num_experts: int, top_k: int, capacity_factor,
                backend: str, iters: int, repeat: int = 10) -> dict:
  """Decode latency: one dispatch + combine round trip (routing included, and
  the row paths alone) per path, ``tokens`` per rank."""
  inputs = ep_inputs(mesh, tokens, hidden, num_experts, top_k, capacity_factor, tokens)
  x, idx, weights = inputs.dispatch_args
  reason = auto_exchange_reason(backend, "ep", mesh.shape["ep"], mesh)
  result = {"tokens_per_rank": tokens, "num_experts": num_experts,
            "expert_capacity": inputs.expert_capacity, "send_capacity": inputs.send_capacity,
            "peer_unsupported_reason": reason}
  for path in PATHS if reason is None else PATHS[:1]:
    exchange = dict(transport=backend, exchange=path, mesh=mesh)
    options = inputs.dispatch_options(backend, path)
    plan = inputs.plan(backend, path)

    def round_trip(x, idx, weights):
      d = dispatch(x, idx, weights, **options)
      return combine(d.tokens, d.handle, num_tokens=tokens, axis_name="ep", **exchange)

    def rows_round_trip(x, handle):
      return row_paths.slabs_to_rows(plan, row_paths.rows_to_slabs(plan, x, handle), handle)

    handle = jax.jit(per_rank(mesh, lambda *a: dispatch(*a, **options).handle))(x, idx, weights)
    slabs = jax.jit(per_rank(mesh, lambda x, h: row_paths.rows_to_slabs(plan, x, h)))(x, handle)
    # The round trip's parts, each alone (where the decode time goes).
    parts = {
        "round_trip_us": (round_trip, (x, idx, weights)),
        "rows_round_trip_us": (rows_round_trip, (x, handle)),
        "routing_us": (routing_only(plan), (idx, weights)),
        "dispatch_rows_us": (lambda x, h: row_paths.rows_to_slabs(plan, x, h), (x, handle)),
        "combine_rows_us": (lambda s, h: row_paths.slabs_to_rows(plan, s, h), (slabs, handle))}
    result[path] = {name: 1e3 * _timed(mesh, fn, args, repeat=repeat, iters=iters)["ms"]
                    for name, (fn, args) in parts.items()}
  return result


def run(token_counts=(4096, 8192), expert_counts=(64, 256), hidden=7168, top_k=8,
        capacity_factor=1.25, backend="auto", iters=5, repeat=10,
        grids=((None, 16), (None, 44), (None, 66), (None, 88), (16, None), (32, None),
               ("half", None)),
        decode_tokens=128, decode_experts=256, fp8_dispatch=True) -> dict:
  """Every case over all devices of the job (``grids``: ``(row_blocks,
  send_blocks)`` of the fused peer row kernels to time besides the default,
  at the first expert count; None: the default, "half": half the SMs;
  ``fp8_dispatch``: FP8 dispatch rows against bf16 at the first expert
  count)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
  sms = _multiprocessors()
  grids = tuple(tuple((sms or 132) // 2 if b == "half" else b for b in g) for g in grids)
  cases = [case(mesh, t, hidden, e, top_k, capacity_factor, backend, iters, repeat,
                grids if e == expert_counts[0] else (),
                with_fp8=fp8_dispatch and e == expert_counts[0])
           for t in token_counts for e in expert_counts]
  raw = [raw_case(mesh, c["send_capacity"], hidden, backend, iters, repeat)
         for c in cases if c["num_experts"] == expert_counts[0]]
  decode = decode_case(mesh, decode_tokens, hidden, decode_experts, top_k, capacity_factor,
                       backend, iters, repeat)
  peer.raise_if_failed()
  return {"ep_size": mesh.shape["ep"], "processes": jax.process_count(), "hidden": hidden,
          "top_k": top_k, "dtype": "bfloat16", "capacity_factor": capacity_factor,
          "transport": backend, "repeat": repeat, "multiprocessors": sms,
          "peer_buffer_bytes_per_process": peer.buffer_bytes(),
          "cases": cases, "raw": raw, "decode": decode}


def _gbs(timing: dict) -> str:
  received = timing.get("received_gbs")
  extra = "" if received is None else f" / {received:.0f}"
  return f"{timing['ms'] * 1e3:7.1f} us {timing['off_device_gbs']:4.0f}{extra} GB/s"


def summary(result: dict) -> str:
  lines = [f"P2 EP={result['ep_size']} ({result['processes']} processes) H={result['hidden']} "
           f"K={result['top_k']} bf16; GB/s per GPU: off-device / received incl. local"]
  for c in result["cases"]:
    lines.append(f"  T={c['tokens_per_rank']} E={c['num_experts']} S={c['send_capacity']} "
                 f"C={c['expert_capacity']}")
    for path in PATHS:
      t = c.get(path)
      if t is None:
        lines.append(f"    {path}: n/a ({c['peer_unsupported_reason']})")
        continue
      equal = "" if t["bitwise_equal_to_all_to_all"] else "  MISMATCH"
      lines.append(f"    {path:10s} dispatch {_gbs(t['dispatch'])} | rows "
                   f"{_gbs(t['dispatch_rows'])} | combine {_gbs(t['combine'])}{equal}")
      lines.append(f"    {'':10s} routing alone {1e3 * t['routing']['ms']:.1f} us")
      if "dispatch_fp8" in t:
        equal = "" if t["fp8_bitwise_equal_to_all_to_all"] else "  MISMATCH"
        lines.append(
            f"    {'':10s} FP8 dispatch {_gbs(t['dispatch_fp8'])} "
            f"({t['dispatch_fp8']['speedup_vs_bf16']:.2f}x) | named "
            f"{_gbs(t['dispatch_fp8_named'])} ({t['dispatch_fp8_named']['speedup_vs_bf16']:.2f}x)"
            f" | rows {_gbs(t['dispatch_rows_fp8'])} "
            f"({t['dispatch_rows_fp8']['speedup_vs_bf16']:.2f}x){equal}")
        lines.append(
            f"    {'':10s} to FP8 slabs: dispatch {_gbs(t['dispatch_fp8_slabs'])} "
            f"({t['dispatch_fp8_slabs']['speedup_vs_bf16']:.2f}x) | rows "
            f"{_gbs(t['dispatch_rows_fp8_slabs'])} "
            f"({t['dispatch_rows_fp8_slabs']['speedup_vs_bf16']:.2f}x)")
      for g in t.get("grids", []):
        blocks = {k: f"{v['send_blocks']}/{v['send_blocks'] + v['recv_blocks']}"
                  for k, v in g["grid"].items()}
        fp8_rows = (f" | FP8 rows {_gbs(g['dispatch_rows_fp8_slabs'])}"
                    if "dispatch_rows_fp8_slabs" in g else "")
        lines.append(f"      send/all blocks {blocks['dispatch']:>7s}: rows "
                     f"{_gbs(g['dispatch_rows'])} | {blocks['combine']:>7s}: combine "
                     f"{_gbs(g['combine'])}{fp8_rows}")
  for r in result["raw"]:
    line = f"  raw {r['shape_per_rank']}: all_to_all {_gbs(r['all_to_all'])}"
    if "peer_exchange" in r:
      line += (f" | peer exchange {_gbs(r['peer_exchange'])}"
               f" | peer-write ceiling {_gbs(r['peer_write_ceiling'])}")
    lines.append(line)
  d = result["decode"]
  for path in PATHS:
    if path in d:
      lines.append(f"  decode T={d['tokens_per_rank']} E={d['num_experts']} {path}: round trip "
                   f"{d[path]['round_trip_us']:.1f} us (rows alone "
                   f"{d[path]['rows_round_trip_us']:.1f} us: dispatch "
                   f"{d[path]['dispatch_rows_us']:.1f} + combine "
                   f"{d[path]['combine_rows_us']:.1f}; routing alone "
                   f"{d[path]['routing_us']:.1f} us)")
  return "\n".join(lines)
