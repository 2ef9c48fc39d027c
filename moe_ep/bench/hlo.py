"""Reading compiled HLO text: which collectives it issues, under which scope
(used by the remat benchmark and by the tests)."""

import re

_COLLECTIVE = re.compile(
    r"\s(all-to-all|all-to-all-start|all-gather|all-gather-start|all-reduce|"
    r"all-reduce-start|collective-permute|collective-permute-start|reduce-scatter|"
    r"ragged-all-to-all)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def collectives(hlo_text: str) -> list[tuple[str, str, str]]:
  """``(opcode, op_name, line)`` of every collective instruction (async ones
  counted once, by their start)."""
  found = []
  for line in hlo_text.splitlines():
    match = _COLLECTIVE.search(line)
    if match is None:
      continue
    name = _OP_NAME.search(line)
    found.append((match.group(1).removesuffix("-start"), name.group(1) if name else "", line))
  return found


def count(hlo_text: str, opcode: str = "all-to-all", scope: str = "") -> int:
  """Collectives of ``opcode`` whose op_name contains ``scope``."""
  return sum(1 for op, name, _ in collectives(hlo_text) if op == opcode and scope in name)
