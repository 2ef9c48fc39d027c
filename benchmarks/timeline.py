"""Where one call's device time goes: the kernels (GPU) or XLA ops (CPU) of
P2's dispatch (bf16 rows, and the FP8 dispatch up to its FP8 slabs) and of
the decode round trip, each in order with its start and duration, from a
``jax.profiler`` trace of a few calls.

What each line is: on GPU the kernels on device 0's streams (XLA's fusions
and the transport's CuPy kernels by name, e.g. ``route_rank``,
``peer_exchange_v16``, ``peer_dispatch``); on CPU the ops the XLA runtime
records on its threads (every device's ops, on whichever thread ran them).
Calls are told apart on GPU by the host's round trip between them (the
widest gaps between kernels split them), on CPU by the host-side span of
each call. With one process driving several GPUs, device 0's kernels that
wait for another GPU (the peer exchanges) include that GPU's lag; each
call also lists the other GPUs' kernels (``other_gpus``), timed from
device 0's first, so the lag shows as their later starts.

It also reads the Chrome trace ``jax.profiler.trace`` writes beside its
protobuf (:func:`read_trace`, :func:`op_events`): every device op with the
compiled instruction it ran, which ``examples/profile_step.py`` attributes
to the parts of a train step.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import os
import pathlib
import re
import statistics
import tempfile
from typing import NamedTuple

import jax
import numpy as np

from benchmarks import ep
from benchmarks.ep_inputs import ep_inputs, per_rank, routing_only
from moe_ep.transport import combine, dispatch, row_paths


def _is_cpu_op(name: str) -> bool:
  """An XLA op's event on the CPU runtime's threads (lower case: ``ynn_fusion``,
  ``all-to-all.1``), not the runtime's own (``ThunkExecutor::Execute``,
  ``Handle inputs``, ``Rendezvous``)."""
  return " " not in name and name == name.lower()


_SUMMARY_EVENTS = 40  # events per program the summary lists
_CALL = "moe_ep_timeline_call"  # the host-side annotation around each traced call


def _gpu_kernels(profile) -> dict[int, list[tuple[float, float, str]]]:
  """Per GPU (its index in the plane name ``/device:GPU:<i>``) with kernels,
  ``(start_ns, duration_ns, name)`` of the kernels on its streams, sorted by
  start (the profiler puts every GPU's on one clock)."""
  kernels = {}
  for plane in profile.planes:
    prefix = "/device:GPU:"
    if not plane.name.startswith(prefix):
      continue
    digits = "".join(itertools.takewhile(str.isdigit, plane.name[len(prefix):]))
    events = [(e.start_ns, e.duration_ns, e.name) for line in plane.lines
              if "stream" in line.name.lower() for e in line.events]
    if digits and events:
      kernels.setdefault(int(digits), []).extend(events)
  return {gpu: sorted(events) for gpu, events in sorted(kernels.items())}


def _calls_of(profile, calls: int) -> list[list[tuple[float, float, str]]]:
  """Per call, ``(start_ns, duration_ns, name)`` of device 0's kernels (GPU)
  or of the XLA CPU runtime's ops, sorted by start. A GPU plane without
  kernels (the programs ran on CPU on a machine with a GPU) is ignored."""
  events = _gpu_kernels(profile).get(0)
  if events:
    return split_calls(events, calls)
  events, windows = [], []
  for plane in profile.planes:
    for line in plane.lines:
      windows += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events
                  if e.name == _CALL]
      if line.name.startswith("tf_XLA"):  # the client's and the Eigen pool's threads
        events += [(e.start_ns, e.duration_ns, e.name) for e in line.events
                   if _is_cpu_op(e.name)]
  return [sorted(e for e in events if start <= e[0] < end) for start, end in sorted(windows)]


def split_calls(events: list[tuple[float, float, str]], calls: int) -> list[list]:
  """``events`` (sorted by start) split into ``calls`` groups at the widest
  gaps between one event's end and the next one's start."""
  if calls < 1:
    raise ValueError(f"calls={calls} must be >= 1")
  if len(events) < calls:
    raise ValueError(f"{len(events)} events cannot make {calls} calls")
  ends = np.maximum.accumulate([start + duration for start, duration, _ in events])
  gaps = [events[i + 1][0] - ends[i] for i in range(len(events) - 1)]
  cuts = sorted(np.argsort(gaps, kind="stable")[::-1][:calls - 1] + 1)
  return [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)])]


def _events(group, t0: float) -> list[dict]:
  return [{"name": name, "start_us": (start - t0) / 1e3, "us": duration / 1e3}
          for start, duration, name in group]


def _call_record(group, others: dict | None = None) -> dict:
  """One call of device 0 (``group``), and ``others``: the same call's
  kernels on each other GPU, their starts also from device 0's first."""
  t0 = group[0][0]
  end = max(start + duration for start, duration, _ in group)
  record = {"span_us": (end - t0) / 1e3,
            "busy_us": sum(duration for _, duration, _ in group) / 1e3,
            "events": _events(group, t0)}
  if others:
    record["other_gpus"] = {str(gpu): _events(events, t0) for gpu, events in others.items()}
  return record


def _other_gpus_calls(profile, calls: int) -> list[dict[int, list]]:
  """Per call, the kernels of every GPU but 0 (one process driving several):
  each GPU's trace split into its calls as device 0's is."""
  split = {gpu: split_calls(events, calls) for gpu, events in _gpu_kernels(profile).items()
           if gpu != 0 and len(events) >= calls}
  return [{gpu: groups[i] for gpu, groups in split.items()} for i in range(calls)]


def trace_calls(fn, args, *, calls: int = 3) -> list[dict]:
  """``fn(*args)`` (jitted) run ``calls`` times under the profiler, after
  two untraced calls and one traced call that is dropped (the CPU tracer can
  miss part of the first call after it starts): per call its span, the sum
  of its events' durations and the events in order."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  folder = tempfile.mkdtemp(prefix="moe-ep-timeline-")
  with jax.profiler.trace(folder):
    for _ in range(calls + 1):
      with jax.profiler.TraceAnnotation(_CALL):
        jax.block_until_ready(fn(*args))
  (path,) = glob.glob(folder + "/**/*.xplane.pb", recursive=True)
  profile = jax.profiler.ProfileData.from_file(path)
  groups = _calls_of(profile, calls + 1)
  if len(groups) != calls + 1 or not all(groups):
    raise RuntimeError(f"the trace gave {[len(g) for g in groups]} events for {calls + 1} calls")
  others = _other_gpus_calls(profile, calls + 1)
  return [_call_record(group, other) for group, other in zip(groups[1:], others[1:])]


def _case(mesh, tokens, hidden, num_experts, top_k, capacity_factor, backend, exchange) -> dict:
  """P2's inputs at one shape, the keyword arguments of its dispatch, and the
  plan of its dispatch with FP8 slabs (resolved as dispatch resolves it)."""
  inputs = ep_inputs(mesh, tokens, hidden, num_experts, top_k, capacity_factor,
                     tokens + num_experts)
  return dict(args=inputs.dispatch_args, options=inputs.dispatch_options(backend, exchange),
              fp8_slabs_plan=inputs.plan(backend, exchange, wire_dtype=ep.FP8,
                                         checkpoint_name=ep.FP8_CHECKPOINT_NAME))


def run(tokens=8192, num_experts=64, decode_tokens=128, decode_experts=256, hidden=7168,
        top_k=8, capacity_factor=1.25, backend="auto", exchange="auto", calls=3) -> dict:
  """Per program (``dispatch``, ``dispatch_fp8_slabs``, ``decode_round_trip``)
  the traced calls over every device of the job (``exchange``: as
  :func:`~moe_ep.transport.dispatch`'s)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
  smap = lambda fn: jax.jit(per_rank(mesh, fn))  # noqa: E731
  big = _case(mesh, tokens, hidden, num_experts, top_k, capacity_factor, backend, exchange)
  fp8_slabs_plan = big["fp8_slabs_plan"]
  fp8_routing = routing_only(fp8_slabs_plan)
  small = _case(mesh, decode_tokens, hidden, decode_experts, top_k, capacity_factor, backend,
                exchange)

  def round_trip(x, idx, weights):
    d = dispatch(x, idx, weights, **small["options"])
    return combine(d.tokens, d.handle, num_tokens=decode_tokens, axis_name="ep", transport=backend,
                   exchange=exchange, mesh=mesh)

  programs = {
      "dispatch": (lambda x, idx, w: dispatch(x, idx, w, **big["options"]), big),
      "dispatch_fp8_slabs": (lambda x, idx, w: row_paths.rows_to_fp8_slabs(
          fp8_slabs_plan, x, fp8_routing(idx, w)), big),
      "decode_round_trip": (round_trip, small)}
  result = {"ep_size": mesh.shape["ep"], "processes": jax.process_count(), "hidden": hidden,
            "top_k": top_k, "capacity_factor": capacity_factor, "transport": backend,
            "exchange": exchange, "tokens_per_rank": tokens, "num_experts": num_experts,
            "decode_tokens_per_rank": decode_tokens, "decode_experts": decode_experts,
            "programs": {}}
  for name, (fn, case) in programs.items():
    result["programs"][name] = trace_calls(smap(fn), case["args"], calls=calls)
  return result


def summary(result: dict) -> str:
  lines = [f"timeline EP={result['ep_size']} ({result['processes']} processes) "
           f"T={result['tokens_per_rank']} E={result['num_experts']}, decode "
           f"T={result['decode_tokens_per_rank']} E={result['decode_experts']}; device 0, "
           f"the call of median span"]
  for name, calls in result["programs"].items():
    spans = [c["span_us"] for c in calls]
    call = calls[spans.index(statistics.median_low(spans))]
    spans_text = ", ".join(f"{s:.1f}" for s in spans)
    lines.append(f"  {name}: span {call['span_us']:.1f} us (calls: {spans_text})")
    lines += _event_lines(call["events"], "    ")
    for gpu, events in call.get("other_gpus", {}).items():
      lines.append(f"    GPU {gpu}, the same call (starts from GPU 0's first kernel):")
      lines += _event_lines(events, "      ")
  return "\n".join(lines)


def _event_lines(events: list[dict], indent: str) -> list[str]:
  lines = [f"{indent}{e['start_us']:8.1f} +{e['us']:7.1f}  {e['name'][:70]}"
           for e in events[:_SUMMARY_EVENTS]]
  if len(events) > _SUMMARY_EVENTS:
    lines.append(f"{indent}... {len(events) - _SUMMARY_EVENTS} more (in the JSON)")
  return lines


# --- the Chrome trace jax.profiler writes (examples/profile_step.py reads it) -------------

class OpEvent(NamedTuple):
  """A device op of the trace: ``[start, end)`` in microseconds."""

  device: str
  line: tuple
  start: float
  end: float
  hlo_module: str
  hlo_op: str
  kernel: str  # the event's own name: a GPU kernel's, or the op's on CPU
  run_id: str


def read_trace(trace_dir: pathlib.Path) -> dict:
  """The Chrome-trace JSON jax.profiler.trace wrote under ``trace_dir``
  (``plugins/profile/<run>/*.trace.json.gz``, or the
  ``perfetto_trace.json.gz`` copy), of the newest run."""
  runs = sorted((trace_dir / "plugins" / "profile").glob("*"), key=os.path.getmtime)
  for run in reversed(runs):
    files = sorted(run.glob("*.trace.json.gz")) or sorted(run.glob("perfetto_trace.json.gz"))
    if files:
      with gzip.open(files[0], "rt") as stream:
        return json.load(stream)
  raise FileNotFoundError(f"no *.trace.json.gz or perfetto_trace.json.gz under "
                          f"{trace_dir}/plugins/profile/")


_ANNOTATED = {key: re.compile(rf"\b{key}=([^,#\s]+)") for key in ("hlo_op", "hlo_module")}


def hlo_names(args: dict) -> tuple[str, str]:
  """``(hlo_op, hlo_module)`` of an event: its args of those names, else
  parsed from an annotation arg (XLA's ``"fusion.3:#hlo_op=fusion.3,
  hlo_module=jit_step,program_id=7#"``); ``""`` where absent. A module name's
  appended program id (``"jit_step(42)"``) is dropped."""
  names = {}
  for key, pattern in _ANNOTATED.items():
    value = args.get(key)
    if value is None:
      for text in args.values():
        match = pattern.search(text) if isinstance(text, str) else None
        if match:
          value = match.group(1)
          break
    names[key] = re.sub(r"\(\d+\)$", "", str(value or "").strip())
  return names["hlo_op"], names["hlo_module"]


def op_events(trace: dict) -> list[OpEvent]:
  """The device op events of a Chrome trace from jax.profiler.

  GPU: the events of a ``/device:...`` process's CUDA stream lines
  (``thread_name`` starting with "Stream"), every kernel and memcpy of them,
  with ``args.hlo_op`` where XLA annotated the launch; where a device has no
  stream lines, its lines whose events carry ``hlo_op`` (e.g. "XLA Ops").
  CPU: the host events carrying ``args.hlo_op`` and ``args.device_ordinal``
  (the thunk executor's, on its worker threads; a while loop's event
  encloses its body's). See :func:`hlo_names` for where the op comes from.
  """
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  process_names, thread_names = {}, {}
  for event in events:
    if event.get("ph") == "M" and event.get("name") == "process_name":
      process_names[event.get("pid")] = str(event.get("args", {}).get("name", ""))
    elif event.get("ph") == "M" and event.get("name") == "thread_name":
      name = str(event.get("args", {}).get("name", ""))
      thread_names[(event.get("pid"), event.get("tid"))] = name
  device_pids = {pid for pid, name in process_names.items() if "/device:" in name}
  stream_lines = {key for key, name in thread_names.items()
                  if key[0] in device_pids and name.lower().startswith("stream")}
  pids_with_streams = {pid for pid, _ in stream_lines}
  found = []
  for event in events:
    if event.get("ph") != "X" or "dur" not in event:
      continue
    args = event.get("args") or {}
    pid, line = event.get("pid"), (event.get("pid"), event.get("tid"))
    hlo_op, hlo_module = hlo_names(args)
    if pid in device_pids:
      if pid in pids_with_streams:
        if line not in stream_lines:
          continue
      elif not hlo_op:
        continue
      device = process_names[pid]
    elif hlo_op and "device_ordinal" in args:
      device = f"{process_names.get(pid, pid)} device_ordinal {args['device_ordinal']}"
    else:
      continue
    start = float(event["ts"])
    found.append(OpEvent(device, line, start, start + float(event["dur"]), hlo_module, hlo_op,
                         str(event.get("name", "")), str(args.get("run_id", ""))))
  return found
