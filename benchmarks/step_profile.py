"""Where a profiled train step's time goes: each XLA op of the compiled
step classified by the part of the model it belongs to (its named scopes,
its opcode, its neighbours), and each GPU op event's busy time attributed so
overlapping and nested ops are counted once (``examples/profile_step.py``
runs the step and writes the report).
"""

from __future__ import annotations

import collections
import pathlib
import re
from typing import NamedTuple

from benchmarks.hlo import Instruction
from benchmarks.timeline import OpEvent
from moe_ep.transport import NAMED_SCOPES as TRANSPORT_SCOPES

TOP_OPS = 20  # the costliest ops a breakdown lists

# Rows of the table, in order; they sum to the step.
ATTENTION, EXPERTS, DISPATCH, COLLECTIVES = ("attention", "expert GEMMs",
                                             "dispatch/combine", "collectives")
ROUTER, DENSE_MLP, LOSS, OPTIMIZER = "router", "dense MLP", "unembed + loss", "optimizer"
REMAT, OTHER, IDLE = "remat recompute", "other", "idle / host gaps"
CATEGORIES = (ATTENTION, EXPERTS, DISPATCH, COLLECTIVES, ROUTER, DENSE_MLP, LOSS, OPTIMIZER,
              REMAT, OTHER)
# Where in the step an op runs: the forward pass, the backward pass (the
# gradient, remat recompute included), or neither (optimizer update, metrics).
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"

# jax.named_scope names: the transport's (moe_ep.transport.NAMED_SCOPES), the
# CuPy and peer launches', the layer's (moe_ep.layer.NAMED_SCOPES) and the
# example's. A scope matches one whole component of op_name.
DISPATCH_SCOPES = frozenset(TRANSPORT_SCOPES.values())
DISPATCH_SCOPE_PREFIXES = ("moe_cupy_", "moe_peer_")
SCOPES = {
    ROUTER: ("moe_router", "expert_bias"),
    EXPERTS: ("moe_experts", "moe_shared_experts"),
    ATTENTION: ("attention",),
    DENSE_MLP: ("dense_mlp",),
    LOSS: ("unembed", "loss"),
    OPTIMIZER: ("optimizer",),
}
# Instructions that only move tuples and loop state around: no neighbour to
# borrow an op_name from (they lead out of the op's own region).
PLUMBING_OPCODES = frozenset({"parameter", "tuple", "get-tuple-element", "while",
                              "conditional", "call", "constant"})
NEIGHBOUR_HOPS = 3
REMAT_SCOPE = "rematted_computation"  # jax.checkpoint's recompute in the backward pass
COLLECTIVE_OPCODES = frozenset(
    f"{op}{suffix}" for op in ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
                               "collective-permute", "collective-broadcast",
                               "ragged-all-to-all")
    for suffix in ("", "-start", "-done"))
# Fallbacks where the example has no "attention" scope: cuDNN flash attention
# custom calls, and the two einsums of jax.nn.dot_product_attention's XLA path.
ATTENTION_TARGETS = re.compile(r"cudnn\$fmha|fmha|flash", re.IGNORECASE)
ATTENTION_OP_NAMES = re.compile(r"dot_product_attention|BTNH,BSNH->BNTS|BNTS,BSNH->BTNH")
# Kernels of kernels/*.cu by name, for a GPU kernel event without an hlo_op.
TRANSPORT_KERNELS = re.compile(r"^(route_|slab_|peer_|expand_rows_|gather_sum_rows_|"
                               r"quantize_pack_|unpack_dequantize_expand_)")


# --- the compiled program ------------------------------------------------------------------------

def _scope_tokens(op_name: str) -> set[str]:
  """The components of ``op_name`` a named scope can be: split at ``/``, at
  the parentheses of transformations (``transpose(jvp())``, ``jit(f)``) and at
  the separators XLA uses where it merged several ops' names (``;`` ``:``)."""
  return {token for token in re.split(r"[/;:()]", op_name) if token}


class Classified(NamedTuple):
  """Where an instruction's time goes.

  Attributes:
    category: a row of the table (:data:`CATEGORIES`).
    step_pass: ``forward``, ``backward`` or ``update``; ``""`` where unknown.
    recomputes: for ``remat recompute``, the category of what it recomputes.
    inferred: whether the op_name it was classified by is a neighbour's.
  """

  category: str
  step_pass: str
  recomputes: str = ""
  inferred: bool = False


class Classifier:
  """Classifies the instructions of the compiled step (:class:`Classified`).

  Rules, first match wins (scopes are whole components of op_name):

  1. ``remat recompute``: under ``rematted_computation`` (jax.checkpoint's
     recompute, in the backward pass); :meth:`classify` also says what it
     recomputes (the category rules 2-9 would give).
  2. ``dispatch/combine``: under a transport scope (``moe_dispatch_fwd``,
     ``moe_dispatch_bwd``, ``moe_combine_fwd``, ``moe_combine_bwd``) or a
     ``moe_cupy_*`` / ``moe_peer_*`` launch, collectives included.
  3. ``collectives``: any other collective opcode (gradient all-reduces,
     the aux statistics' psums, XLA's resharding).
  4. ``router``: ``moe_router``, ``expert_bias`` (the bias update).
  5. ``expert GEMMs``: ``moe_experts``, ``moe_shared_experts`` (their
     activations and the combine weights' multiply too).
  6. ``attention``: the ``attention`` scope where the program has one, else
     cuDNN flash-attention custom calls and jax.nn.dot_product_attention's
     two einsums (``BTNH,BSNH->BNTS``, ``BNTS,BSNH->BTNH``).
  7. ``dense MLP`` (``dense_mlp``), 8. ``unembed + loss`` (``unembed``,
     ``loss``).
  9. ``optimizer``: the ``optimizer`` scope where the program has one, else
     every op of ``jit(step)`` outside the gradient (neither ``jvp(`` nor
     ``transpose(``: the AdamW update, gradient clipping, metrics).
  10. ``other``.

  Pass: ``backward`` where op_name has ``transpose(`` (or a ``*_bwd``
  transport scope), ``forward`` where it has ``jvp(``, else ``update``.

  The op_name is the instruction's own; for a fusion without one, those of
  the instructions it fuses; for an instruction without any (XLA's rewrites of
  a dot's batch dimensions, e.g. of the expert GEMMs at one expert per device,
  drop the metadata on CPU), the nearest named users' (else operands'), and
  the result says it was inferred.

  Args:
    instructions: the compiled step's, from :func:`parse_hlo`.
    computations: its computations' instruction names.
  """

  def __init__(self, instructions: dict[str, Instruction],
               computations: dict[str, list[str]] | None = None):
    self.instructions = instructions
    self.computations = computations or {}
    tokens = set().union(*(_scope_tokens(i.op_name) for i in instructions.values()))
    self.kernel_scopes = sorted(t for t in tokens if t.startswith(DISPATCH_SCOPE_PREFIXES))
    self.scopes_present = {category: [s for s in scopes if s in tokens]
                           for category, scopes in SCOPES.items()}
    self.entry_prefix = self._entry_prefix()
    self._user_map = None

  def _entry_prefix(self) -> str:
    """``"jit(step)/"``: the first component most op_names share."""
    heads = collections.Counter(i.op_name.split("/", 1)[0] for i in self.instructions.values()
                                if i.op_name.startswith("jit("))
    return heads.most_common(1)[0][0] + "/" if heads else "jit("

  def rules(self) -> dict[str, str]:
    """How each scope-based category was found in this program (for the report)."""
    described = {}
    for category, present in self.scopes_present.items():
      if present:
        described[category] = "scope " + ", ".join(f"'{s}'" for s in present)
      elif category == ATTENTION:
        described[category] = ("no 'attention' scope: cuDNN fmha custom calls and the "
                               "dot_product_attention einsums only (softmax, projections "
                               "and rotary count as other)")
      elif category == OPTIMIZER:
        described[category] = (f"no 'optimizer' scope: every op of {self.entry_prefix.rstrip('/')}"
                               " outside jvp/transpose (AdamW, clipping, metrics, bias update)")
      else:
        described[category] = f"no {' / '.join(repr(s) for s in SCOPES[category])} scope: none"
    return described

  def own_op_name(self, instruction: Instruction) -> str:
    """``instruction``'s op_name, or for a fusion without one, the op_names
    of the instructions it fuses joined by ``;``."""
    if instruction.op_name or not instruction.calls:
      return instruction.op_name
    inner = [self.instructions[n].op_name for c in instruction.calls
             for n in self.computations.get(c, ()) if n in self.instructions]
    return ";".join(dict.fromkeys(n for n in inner if n))

  def _users(self) -> dict[str, list[str]]:
    if self._user_map is None:
      self._user_map = collections.defaultdict(list)
      for instruction in self.instructions.values():
        for operand in instruction.operands:
          self._user_map[operand].append(instruction.name)
    return self._user_map

  def neighbour_op_name(self, instruction: Instruction) -> str:
    """The most common op_name of the nearest users of ``instruction`` that
    have one (through unnamed ones, up to :data:`NEIGHBOUR_HOPS` away), else
    of its nearest operands'; ``""`` if none. Names XLA merged from several ops (``:``,
    ``;``) and tuple plumbing are passed over: they say little about one op."""
    users = self._users()
    for edges in (lambda n: users.get(n, ()), lambda n: self.instructions[n].operands):
      frontier, seen = [instruction.name], {instruction.name}
      for _ in range(NEIGHBOUR_HOPS):
        found, unnamed = [], []
        for name in frontier:
          for neighbour in edges(name):
            if neighbour in seen or neighbour not in self.instructions:
              continue
            seen.add(neighbour)
            other = self.instructions[neighbour]
            if other.opcode in PLUMBING_OPCODES:
              continue
            op_name = self.own_op_name(other)
            if not op_name:
              unnamed.append(neighbour)
            elif ":" not in op_name and ";" not in op_name:
              found.append(op_name)
        if found:
          return collections.Counter(found).most_common(1)[0][0]
        frontier = unnamed
    return ""

  def op_name(self, instruction: Instruction) -> tuple[str, bool]:
    """``(op_name, whether it is a neighbour's)``: :meth:`own_op_name`, else
    :meth:`neighbour_op_name` (XLA's rewrites, e.g. of a dot's batch
    dimensions, can leave an instruction without metadata)."""
    own = self.own_op_name(instruction)
    if own:
      return own, False
    return self.neighbour_op_name(instruction), True

  def category(self, instruction: Instruction, op_name: str) -> str:
    """Rules 2-10 of the class docstring."""
    tokens = _scope_tokens(op_name)
    if tokens & DISPATCH_SCOPES or any(t.startswith(DISPATCH_SCOPE_PREFIXES) for t in tokens):
      return DISPATCH
    if instruction.opcode in COLLECTIVE_OPCODES:
      return COLLECTIVES
    for category in (ROUTER, EXPERTS):
      if tokens.intersection(SCOPES[category]):
        return category
    if self._in_scope_or(ATTENTION, tokens, ATTENTION_TARGETS.search(instruction.target)
                         or ATTENTION_OP_NAMES.search(op_name)):
      return ATTENTION
    for category in (DENSE_MLP, LOSS):
      if tokens.intersection(SCOPES[category]):
        return category
    if self._in_scope_or(OPTIMIZER, tokens, op_name.startswith(self.entry_prefix)
                         and "jvp(" not in op_name and "transpose(" not in op_name):
      return OPTIMIZER
    return OTHER

  def _in_scope_or(self, category: str, tokens: set[str], fallback) -> bool:
    """Whether an op of these scope ``tokens`` is in ``category``'s scope
    where the program has one, else whether ``fallback`` holds."""
    if self.scopes_present[category]:
      return bool(tokens.intersection(SCOPES[category]))
    return bool(fallback)

  def classify(self, name: str) -> Classified | None:
    """The :class:`Classified` of the instruction ``name``; None where the
    program has no such instruction or neither it nor a neighbour carries an
    op_name."""
    instruction = self.instructions.get(name)
    if instruction is None:
      return None
    op_name, inferred = self.op_name(instruction)
    if not op_name:
      return None
    tokens = _scope_tokens(op_name)
    category = self.category(instruction, op_name)
    if "transpose(" in op_name or TRANSPORT_SCOPES["dispatch_bwd"] in tokens \
        or TRANSPORT_SCOPES["combine_bwd"] in tokens:
      step_pass = BACKWARD
    elif "jvp(" in op_name:
      step_pass = FORWARD
    else:
      step_pass = UPDATE
    if REMAT_SCOPE in tokens:
      return Classified(REMAT, BACKWARD, category, inferred)
    return Classified(category, step_pass, "", inferred)


# --- the trace -----------------------------------------------------------------------------------

def _innermost_segments(line_events: list[int], events: list[OpEvent]) -> list[tuple]:
  """``(start, end, event index)`` pieces of one line's time, each owned by
  the innermost event running then (a while loop's event owns only the gaps
  between its body's ops). Events that overlap without one holding the
  other are consecutive, the earlier ending where the later starts: on a
  GPU, kernels of one CUDA stream whose timestamps overlap by a fraction of
  a microsecond (about half of an H200 step's kernels)."""
  order = sorted(line_events, key=lambda i: (events[i].start, -events[i].end))
  segments, stack, cursor = [], [], 0.0
  for index in order:
    start, end = events[index].start, events[index].end
    while stack and stack[-1][1] <= start:
      top, top_end = stack.pop()
      if top_end > cursor:
        segments.append((cursor, top_end, top))
      cursor = max(cursor, top_end)
    while stack and stack[-1][1] < end:  # overlapping, not nested: ends here
      top, _ = stack.pop()
      if start > cursor:
        segments.append((cursor, start, top))
      cursor = max(cursor, start)
    if stack and start > cursor:
      segments.append((cursor, start, stack[-1][0]))
    cursor = start
    stack.append((index, end))
  while stack:
    top, top_end = stack.pop()
    if top_end > cursor:
      segments.append((cursor, top_end, top))
    cursor = max(cursor, top_end)
  return segments


def attribute(events: list[OpEvent]) -> tuple[list[float], list[float], dict[str, float]]:
  """Splits each device's busy time between its ops.

  Returns:
    ``(attributed, own, busy)``: per event, its share of the device's time
    (where ``k`` ops run at once each gets ``1/k``) and its own time (its
    duration less its children's on its line), both in microseconds; per
    device, the busy time (the union of its ops' intervals).
  """
  attributed, own = [0.0] * len(events), [0.0] * len(events)
  busy = collections.defaultdict(float)
  lines = collections.defaultdict(list)
  for index, event in enumerate(events):
    lines[(event.device, event.line)].append(index)
  by_device = collections.defaultdict(list)
  for (device, _), indices in lines.items():
    for start, end, index in _innermost_segments(indices, events):
      own[index] += end - start
      by_device[device].append((start, end, index))
  for device, segments in by_device.items():
    points = sorted([(s, 1, i) for s, _, i in segments] + [(e, 0, i) for _, e, i in segments])
    active, previous = collections.Counter(), None
    for time_us, is_start, index in points:
      if active and previous is not None and time_us > previous:
        share = (time_us - previous) / sum(active.values())
        for event_index, count in active.items():
          attributed[event_index] += share * count
        busy[device] += time_us - previous
      previous = time_us
      if is_start:
        active[index] += 1
      else:
        active[index] -= 1
        if not active[index]:
          del active[index]
  return attributed, own, dict(busy)


# --- the breakdown -------------------------------------------------------------------------------

def breakdown(events: list[OpEvent], classifier: Classifier, module: str, *, steps: int,
              wall_s: float) -> dict:
  """Milliseconds per step by category and pass, and the top ops.

  Args:
    events: the traced steps' device ops (:func:`op_events`).
    classifier: over the compiled step's instructions.
    module: the compiled step's HLO module name (events of other programs
      count as ``other``, unmapped).
    steps: how many steps the trace holds.
    wall_s: their wall time.

  Returns:
    ``rows`` (category -> ms per step, share, per pass, own op time), the
    step and busy times, unmapped time (by why), time classified by a
    neighbour's op_name (by category), remat recompute by what it
    recomputes, per-device busy time, the step executions seen per device
    (from ``run_id``, where the events have one) and ``top_ops``.
  """
  attributed, own, busy = attribute(events)
  devices = sorted(busy) or ["none"]
  per_step = 1e-3 / (steps * len(devices))  # us summed over devices -> ms per step and device
  rows = {c: {"ms": 0.0, FORWARD: 0.0, BACKWARD: 0.0, UPDATE: 0.0, "op_ms": 0.0}
          for c in CATEGORIES}
  remat_parts = collections.Counter()
  unmapped, inferred = collections.Counter(), collections.Counter()
  ops = {}
  runs = collections.defaultdict(set)
  cache = {}
  for index, event in enumerate(events):
    key = (event.hlo_module, event.hlo_op)
    in_step = event.hlo_module == module or (not event.hlo_module
                                             and event.hlo_op in classifier.instructions)
    if key not in cache:
      cache[key] = classifier.classify(event.hlo_op) if in_step and event.hlo_op else None
    found = cache[key]
    if found is None and not event.hlo_op and TRANSPORT_KERNELS.match(event.kernel):
      found = Classified(DISPATCH, "")
    if found is None:
      reason = ("no hlo_op" if not event.hlo_op else
                "other program" if not in_step else
                "not in the compiled step" if event.hlo_op not in classifier.instructions
                else "no op_name")
      unmapped[reason] += attributed[index]
      found = Classified(OTHER, "")
    category, step_pass, recomputes, was_inferred = found
    row = rows[category]
    row["ms"] += attributed[index]
    row["op_ms"] += own[index]
    if step_pass:
      row[step_pass] += attributed[index]
    if recomputes:
      remat_parts[recomputes] += attributed[index]
    if was_inferred:
      inferred[category] += attributed[index]
    if event.run_id and in_step:
      runs[event.device].add(event.run_id)
    name = event.hlo_op or event.kernel
    op = ops.setdefault(name, {"op": name, "ms": 0.0, "events": 0, "category": category,
                               "pass": step_pass, "recomputes": recomputes,
                               "inferred": was_inferred, "kernels": collections.Counter()})
    op["ms"] += attributed[index]
    op["events"] += 1
    op["kernels"][event.kernel] += 1
  wall_ms = wall_s * 1e3 / steps
  busy_ms = sum(busy.values()) * 1e-3 / (steps * len(devices))
  for row in rows.values():
    for field in row:
      row[field] *= per_step
    row["share"] = row["ms"] / wall_ms
  idle_ms = wall_ms - busy_ms
  rows[IDLE] = {"ms": idle_ms, "share": idle_ms / wall_ms}
  top = sorted(ops.values(), key=lambda op: -op["ms"])[:TOP_OPS]
  for op in top:
    instruction = classifier.instructions.get(op["op"])
    op.update(ms=op["ms"] * per_step, events_per_step=op.pop("events") / (steps * len(devices)),
              kernels=[k for k, _ in op["kernels"].most_common(3)],
              opcode=instruction.opcode if instruction else "",
              target=instruction.target if instruction else "",
              op_name=classifier.op_name(instruction)[0] if instruction else "")
  return {
      "step_ms": wall_ms,
      "busy_ms": busy_ms,
      "rows": rows,
      "remat_recomputes": {c: ms * per_step for c, ms in remat_parts.most_common()},
      "unmapped_ms": {reason: ms * per_step for reason, ms in unmapped.most_common()},
      "inferred_ms": {c: ms * per_step for c, ms in inferred.most_common()},
      "device_busy_ms": {d: busy.get(d, 0.0) * 1e-3 / steps for d in devices},
      "executions_seen": {d: len(r) for d, r in sorted(runs.items())},
      "op_events": len(events),
      "top_ops": top,
  }


def xla_instruction_profile(trace_dir: pathlib.Path, classifier: Classifier) -> dict | None:
  """A cross-check from XLA's own reading of the trace: the per-instruction
  times its profile-guided latency estimator takes from the GPU planes
  (``get_instructions_profile``, a private jaxlib API; empty on CPUs), as
  shares by category. None where it gives nothing.

  Shares only: the times are per instruction as XLA aggregates them (not per
  step), so they weigh a loop body's op once, not once per iteration.
  """
  try:
    from jax._src.lib import _profiler  # noqa: PLC0415
    profiled = _profiler.get_instructions_profile(str(trace_dir))
  except Exception:  # noqa: BLE001 - a private API: any failure means no cross-check
    return None
  if not profiled:
    return None
  by_category = collections.Counter()
  for name, cost in profiled:
    found = classifier.classify(name)
    by_category[found.category if found else OTHER] += cost
  total = sum(by_category.values()) or 1.0
  return {"share_by_category": {c: t / total for c, t in by_category.most_common()},
          "instructions": len(profiled)}
