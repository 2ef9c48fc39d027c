"""Reading compiled HLO text: which collectives it issues, under which scope
(used by the remat benchmark and by the tests).

A direct peer exchange (:mod:`moe_ep.transport.peer`) is a custom call, not a
collective; it is counted as the ``all-to-all`` it replaces, so the same
counts hold on either exchange path."""

import re

_COLLECTIVE = re.compile(
    r"\s(all-to-all|all-to-all-start|all-gather|all-gather-start|all-reduce|"
    r"all-reduce-start|collective-permute|collective-permute-start|reduce-scatter|"
    r"ragged-all-to-all)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
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


_COMPUTATION = re.compile(r"^%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_FUSION_KIND = re.compile(r"kind=(\w+)")


def fp8_consumers(hlo_text: str) -> list[dict]:
  """The fusions of a compiled module that read FP8 (``f8e4m3fn``) values:
  for each, its output shape, fusion kind, whether it is a GEMM (a dot
  inside) and its op_name. Tells whether XLA dequantizes FP8 slabs inside
  the expert GEMM's fusion or in a pass of its own that writes them out
  (on the CuPy backend a kernel dequantizes them: no such fusion)."""
  bodies, current = {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header is not None:
      current = header.group(1)
      bodies[current] = []
    elif line.strip() == "}":
      current = None
    elif current is not None:
      bodies[current].append(line)
  found = []
  for line in hlo_text.splitlines():
    if " fusion(" not in line or "calls=" not in line:
      continue
    body = bodies.get(_CALLS.search(line).group(1), [])
    if not any("f8e4m3fn" in inner for inner in body):
      continue
    kind = _FUSION_KIND.search(line)
    name = _OP_NAME.search(line)
    found.append({"shape": line.split("=", 1)[1].split("fusion(", 1)[0].strip(),
                  "kind": kind.group(1) if kind else "",
                  "gemm": any(" dot(" in inner for inner in body),
                  "op_name": name.group(1) if name else ""})
  return found
