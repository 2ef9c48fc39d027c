"""Reading compiled HLO text (``compiled.as_text()``): its instructions
(:func:`parse_hlo`), which collectives it issues under which scope, and which
fusions read FP8 values. Used by the benchmarks, the tests and
``examples/profile_step.py``.

A direct peer exchange (:mod:`moe_ep.transport.peer`) is a custom call, not a
collective; it is counted as the ``all-to-all`` it replaces, so the same
counts hold on either exchange path."""

from __future__ import annotations

import re
from typing import NamedTuple


class Instruction(NamedTuple):
  """One instruction of the compiled HLO text.

  Attributes:
    name: e.g. ``"fusion.12"``: what the trace events name in ``hlo_op``.
    opcode: e.g. ``"fusion"``, ``"all-to-all"``, ``"custom-call"``.
    op_name: the ``metadata={op_name=...}`` JAX wrote (``""`` if none), e.g.
      ``"jit(step)/transpose(jvp())/while/body/.../moe_dispatch_bwd/gather"``.
    target: a custom call's ``custom_call_target``, else ``""``.
    calls: the computations it calls (``calls=``), e.g. a fusion's body.
    operands: the instructions it reads.
    shape: its result's type, e.g. ``"bf16[8,4]{1,0}"``.
    kind: a fusion's ``kind=`` (``"kLoop"``, ``"kCustom"``, ...), else ``""``.
  """

  name: str
  opcode: str
  op_name: str
  target: str
  calls: tuple[str, ...]
  operands: tuple[str, ...]
  shape: str = ""
  kind: str = ""


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([\w\-]+)\(")
_OPERAND = re.compile(r"%?([A-Za-z_][\w.\-]*)")  # type names too: they match no instruction
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="((?:[^"\\]|\\.)*)"')
_CALLS = re.compile(r"\bcalls=([%\w.\-, ]+?)(?:,\s*\w+=|$|\})")
_FUSION_KIND = re.compile(r"\bkind=(\w+)")


def _parenthesised(text: str) -> tuple[str, str]:
  """``("(a, (b))", rest)`` of ``text`` starting with ``(``."""
  depth = 0
  for index, char in enumerate(text):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return text[:index + 1], text[index + 1:]
  return text, ""


def _shape_opcode_and_operands(rest: str) -> tuple[str, str, tuple[str, ...]]:
  """The result type, opcode and operand names of an instruction's right-hand
  side ``shape opcode(operands), attributes`` (a tuple shape is
  parenthesised and may hold spaces)."""
  if rest.startswith("("):
    shape, rest = _parenthesised(rest)
  else:
    shape, _, rest = rest.partition(" ")
  rest = rest.lstrip()
  match = _OPCODE.match(rest)
  if match is None:
    return shape, "", ()
  operands = _parenthesised(rest[match.end() - 1:])[0]
  return shape, match.group(1), tuple(_OPERAND.findall(operands))


def parse_hlo(text: str) -> tuple[str, dict[str, Instruction], dict[str, list[str]]]:
  """``(module name, {instruction name: Instruction}, {computation: its
  instruction names})`` of ``compiled.as_text()``."""
  module = re.search(r"^HloModule\s+([^\s,]+)", text, re.MULTILINE)
  instructions, computations, current = {}, {}, None
  for line in text.splitlines():
    match = _INSTRUCTION.match(line)
    if match is None:
      computation = _COMPUTATION.match(line)
      if computation is not None:
        current = computation.group(1)
        computations[current] = []
      continue
    name, rest = match.groups()
    op_name = _OP_NAME.search(rest)
    target = _TARGET.search(rest)
    calls = _CALLS.search(rest)
    shape, opcode, operands = _shape_opcode_and_operands(rest)
    kind = _FUSION_KIND.search(rest) if opcode == "fusion" else None
    instructions[name] = Instruction(
        name, opcode, op_name.group(1).replace("\\'", "'") if op_name else "",
        target.group(1) if target else "",
        tuple(c.strip().lstrip("%") for c in calls.group(1).split(",")) if calls else (),
        operands, shape, kind.group(1) if kind else "")
    if current is not None:
      computations[current].append(name)
  return (module.group(1) if module else ""), instructions, computations


_COLLECTIVE = re.compile(
    r"\s(all-to-all|all-to-all-start|all-gather|all-gather-start|all-reduce|"
    r"all-reduce-start|collective-permute|collective-permute-start|reduce-scatter|"
    r"ragged-all-to-all)\(")
_CUSTOM_CALL = re.compile(r"\scustom-call\(")
_PEER_SCOPE = "moe_peer_exchange"


def collectives(hlo_text: str) -> list[tuple[str, str, str]]:
  """``(opcode, op_name, line)`` of every collective instruction (async ones
  counted once, by their start)."""
  found = []
  for line in hlo_text.splitlines():
    name = _OP_NAME.search(line)
    op_name = name.group(1) if name else ""
    match = _COLLECTIVE.search(line)
    if match is not None:
      found.append((match.group(1).removesuffix("-start"), op_name, line))
    elif _CUSTOM_CALL.search(line) and _PEER_SCOPE in op_name:
      found.append(("all-to-all", op_name, line))
  return found


def count(hlo_text: str, opcode: str = "all-to-all", scope: str = "") -> int:
  """Collectives of ``opcode`` whose op_name contains ``scope``."""
  return sum(1 for op, name, _ in collectives(hlo_text) if op == opcode and scope in name)


def count_sites(hlo_text: str, opcode: str = "all-to-all", scope: str = "") -> int:
  """Like :func:`count`, but instructions with the same op_name count once:
  XLA may unroll a short loop (a 2-layer scan) and copy its body, and such
  copies are one exchange per iteration, not a re-run."""
  return len({name for op, name, _ in collectives(hlo_text) if op == opcode and scope in name})


def fp8_consumers(hlo_text: str) -> list[dict]:
  """The fusions of a compiled module that read FP8 (``f8e4m3fn``) values:
  for each, its output shape, fusion kind, whether it is a GEMM (a dot
  inside) and its op_name. Tells whether XLA dequantizes FP8 slabs inside
  the expert GEMM's fusion or in a pass of its own that writes them out
  (on the CuPy backend a kernel dequantizes them: no such fusion)."""
  _, instructions, computations = parse_hlo(hlo_text)
  found = []
  for fusion in instructions.values():
    if fusion.opcode != "fusion" or not fusion.calls:
      continue
    body = [instructions[n] for n in computations.get(fusion.calls[0], ())]
    if not any("f8e4m3fn" in inner.shape for inner in body):
      continue
    found.append({"shape": fusion.shape, "kind": fusion.kind,
                  "gemm": any(inner.opcode == "dot" for inner in body),
                  "op_name": fusion.op_name})
  return found
