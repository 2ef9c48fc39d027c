"""examples/profile_step.py and the classifier and attribution it runs
(benchmarks/step_profile.py): overlapping and nested ops split the busy time
exactly, the classifier's rules on a hand-labelled program, and a traced CPU
run whose rows add up to the step, whose busy time is the union of the raw
trace's op intervals and whose trace holds exactly the traced steps."""

import gzip
import json

import jax
import pytest

from tiny_run import FAST_OVERRIDES, TINY_YAML, skip_unless_devices_fit
from examples import profile_step as ps
from benchmarks import common, hlo, timeline
from benchmarks import step_profile as sp
from examples.train_config import load_config

STEPS = 2


def event(start, end, *, device="d0", line="a", hlo_op="op"):
  return timeline.OpEvent(device, line, start, end, "m", hlo_op, hlo_op, "")


def test_nested_and_overlapping_ops_split_the_busy_time_between_them():
  # Line a: a loop [0, 10) around its body's op [2, 5); line b of the same
  # device: [4, 8). Second device: two ops with a gap.
  events = [event(0, 10, hlo_op="loop"), event(2, 5, hlo_op="body"),
            event(4, 8, line="b", hlo_op="other"),
            event(0, 1, device="d1"), event(3, 4, device="d1")]
  attributed, own, busy = sp.attribute(events)
  # Worked by hand: [0,2) loop; [2,4) body; [4,5) body|other; [5,8) loop|other; [8,10) loop.
  assert attributed[:3] == pytest.approx([2 + 1.5 + 2, 2 + 0.5, 0.5 + 1.5])
  assert own[:3] == pytest.approx([7, 3, 4])  # the loop's own time leaves out its body's
  assert busy == pytest.approx({"d0": 10, "d1": 2})
  assert attributed[3:] == pytest.approx([1, 1])


def test_ops_of_one_line_that_overlap_without_nesting_keep_all_their_time():
  # Kernels of one CUDA stream whose timestamps overlap by a little: [0, 4)
  # then [3.9, 9); inside a loop [10, 30): [11, 15) then [14.5, 20), and
  # [19, 31) running past the loop's end. Before, each later op was clipped
  # to the earlier one's end, and the time it ran after that went missing.
  events = [event(0, 4, hlo_op="a"), event(3.9, 9, hlo_op="b"), event(10, 30, hlo_op="loop"),
            event(11, 15, hlo_op="c"), event(14.5, 20, hlo_op="d"), event(19, 31, hlo_op="e")]
  attributed, own, busy = sp.attribute(events)
  assert busy == pytest.approx({"d0": 9 + 21})  # the union of the intervals
  assert sum(attributed) == pytest.approx(30) and sum(own) == pytest.approx(30)
  # each earlier op ends where the later starts; the loop owns its gaps
  assert own == pytest.approx([3.9, 5.1, 1, 3.5, 4.5, 12])


# A hand-written compiled program: each instruction's expected classification
# is written beside it (category, pass, what a remat recompute recomputes).
HLO = """HloModule jit_step, is_scheduled=true

%fused_computation.1 (param_0: f32[8,4]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  ROOT %exp.1 = f32[8,4]{1,0} exponential(%param_0), metadata={op_name="jit(step)/jvp()/moe_router/exp"}
}

ENTRY %main (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  %all-to-all.1 = f32[8,4]{1,0} all-to-all(%p), dimensions={0}, metadata={op_name="jit(step)/jvp()/shard_map/moe_dispatch_fwd/exchange_rows/all_to_all"}
  %gather.2 = f32[8,4]{1,0} gather(%p), metadata={op_name="jit(step)/transpose(jvp())/shard_map/moe_dispatch_bwd/gather"}
  %custom-call.3 = f32[8,4]{1,0} custom-call(%p), custom_call_target="xla_buffer_python_gpu_callback", metadata={op_name="jit(step)/jvp()/moe_combine_fwd/moe_cupy_gather_sum_rows/buffer_callback"}
  %all-reduce.4 = f32[8,4]{1,0} all-reduce(%p), to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/moe_experts/lch,lhf->lcf/psum_invariant"}
  %fusion.5 = f32[8,4]{1,0} fusion(%p), kind=kLoop, calls=%fused_computation.1
  %dot.6 = f32[8,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %multiply.7 = f32[8,4]{1,0} multiply(%dot.6, %p), metadata={op_name="jit(step)/jvp()/while/body/moe_experts/mul"}
  %dot.8 = f32[8,4]{1,0} dot(%p, %p), metadata={op_name="jit(step)/transpose(jvp())/while/body/checkpoint/rematted_computation/moe_experts/dot_general"}
  %dot.9 = f32[8,8]{1,0} dot(%p, %p), metadata={op_name="jit(step)/jvp()/while/body/vmap(BTNH,BSNH->BNTS)/dot_general"}
  %add.10 = f32[8,4]{1,0} add(%p, %p), metadata={op_name="jit(step)/add"}
  %add.11 = f32[8,4]{1,0} add(%p, %p), metadata={op_name="jit(step)/jvp(loss)/add"}
  %sqrt.12 = f32[8,4]{1,0} sqrt(%p), metadata={op_name="jit(step)/jvp()/while/body/rsqrt"}
  %negate.13 = f32[8,4]{1,0} negate(%p)
  ROOT %tuple.14 = (f32[8,4]{1,0}) tuple(%negate.13)
}
"""
EXPECTED = {
    "all-to-all.1": ("dispatch/combine", "forward", ""),
    "gather.2": ("dispatch/combine", "backward", ""),
    "custom-call.3": ("dispatch/combine", "forward", ""),
    "all-reduce.4": ("collectives", "backward", ""),
    "fusion.5": ("router", "forward", ""),  # no op_name of its own: its fused body's
    "dot.6": ("expert GEMMs", "forward", ""),  # no op_name anywhere: its user's
    "dot.8": ("remat recompute", "backward", "expert GEMMs"),
    "dot.9": ("attention", "forward", ""),  # no "attention" scope here: the einsum
    "add.10": ("optimizer", "update", ""),  # no "optimizer" scope: outside the gradient
    "add.11": ("unembed + loss", "forward", ""),  # a scope inside a transformation's name
    "sqrt.12": ("other", "forward", ""),
}


def test_classifier_follows_the_rules_on_a_hand_labelled_program():
  module, instructions, computations = hlo.parse_hlo(HLO)
  assert module == "jit_step"
  assert instructions["all-to-all.1"].opcode == "all-to-all"
  assert instructions["custom-call.3"].target == "xla_buffer_python_gpu_callback"
  assert instructions["fusion.5"].calls == ("fused_computation.1",)
  assert (instructions["fusion.5"].shape, instructions["fusion.5"].kind) == ("f32[8,4]{1,0}",
                                                                             "kLoop")
  assert instructions["tuple.14"].shape == "(f32[8,4]{1,0})"
  assert instructions["dot.6"].operands == ("p", "p") and instructions["dot.6"].kind == ""
  classifier = sp.Classifier(instructions, computations)
  for name, expected in EXPECTED.items():
    found = classifier.classify(name)
    assert (found.category, found.step_pass, found.recomputes) == expected, name
  assert classifier.classify("dot.6").inferred and not classifier.classify("dot.8").inferred
  # Nothing names negate.13 (its only user is the root tuple): unmapped.
  assert classifier.classify("negate.13") is None
  assert classifier.classify("not-there.1") is None
  assert classifier.kernel_scopes == ["moe_cupy_gather_sum_rows"]


def test_a_present_attention_scope_replaces_the_einsum_fallback():
  text = HLO.replace('"jit(step)/jvp()/while/body/rsqrt"',
                     '"jit(step)/jvp()/while/body/attention/rsqrt"')
  _, instructions, computations = hlo.parse_hlo(text)
  classifier = sp.Classifier(instructions, computations)
  assert classifier.classify("sqrt.12").category == "attention"
  assert classifier.classify("dot.9").category == "other"  # outside the scope


def test_annotated_kernels_give_their_op_and_module():
  args = {"kernel_annotation": "fusion.3:#hlo_op=fusion.3,hlo_module=jit_step(12),program_id=7#"}
  assert timeline.hlo_names(args) == ("fusion.3", "jit_step")
  assert timeline.hlo_names({"hlo_op": "dot.1", "hlo_module": "jit_step"}) == ("dot.1", "jit_step")
  assert timeline.hlo_names({"correlation_id": 5}) == ("", "")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
  """A traced CPU run of tiny.yaml (remat on): the report and the raw trace."""
  out = tmp_path_factory.mktemp("out")
  trace_dir = out / "trace"
  overrides = [*FAST_OVERRIDES, "model.remat_blocks=true"]
  skip_unless_devices_fit(load_config(TINY_YAML, overrides))
  assert ps.main([str(TINY_YAML), *overrides, "--steps", str(STEPS), "--warmup", "1",
                  "--out", str(out), "--trace-dir", str(trace_dir)]) == 0
  report_file, = out.glob(f"profile-tiny-*-{jax.device_count()}dev.json")
  return report_file.with_suffix(""), json.loads(report_file.read_text()), trace_dir


def test_rows_add_up_to_the_traced_step(profiled):
  _, report, _ = profiled
  rows = report["rows"]
  assert list(rows) == [*sp.CATEGORIES, sp.IDLE]
  assert sum(row["ms"] for row in rows.values()) == pytest.approx(report["step_ms"], rel=1e-9)
  assert sum(rows[c]["ms"] for c in sp.CATEGORIES) == pytest.approx(report["busy_ms"], rel=1e-9)
  assert sum(row["share"] for row in rows.values()) == pytest.approx(1.0, rel=1e-9)
  assert 0 < report["busy_ms"] < report["step_ms"]
  for category in sp.CATEGORIES:  # forward + backward never exceed the row
    assert rows[category]["forward"] + rows[category]["backward"] <= rows[category]["ms"] + 1e-9


def test_dispatch_experts_and_remat_are_found_in_both_passes(profiled):
  if jax.default_backend() == "gpu" and not ps.command_buffers_off():
    pytest.skip("kernels replayed from CUDA graphs are not attributed to ops; run as a "
                "program, profile_step.py turns command buffers off")
  _, report, _ = profiled
  rows = report["rows"]
  for category in ("dispatch/combine", "expert GEMMs", "collectives", "attention", "router"):
    assert rows[category]["forward"] > 0 and rows[category]["backward"] > 0, category
  assert rows["remat recompute"]["backward"] > 0 and rows["remat recompute"]["forward"] == 0
  assert rows["optimizer"]["ms"] > 0
  # Next to everything is classified by a name (the CPU's rewritten dots by a
  # neighbour's): less than 1% of the busy time is left unmapped.
  assert sum(report["unmapped_ms"].values()) < 0.01 * report["busy_ms"]


def test_busy_time_is_the_union_of_the_raw_traces_op_intervals(profiled):
  _, report, trace_dir = profiled
  if jax.default_backend() != "cpu":
    pytest.skip("the reference reads the CPU's thunk events (args device_ordinal, run_id)")
  trace_file, = trace_dir.glob("plugins/profile/*/*.trace.json.gz")
  with gzip.open(trace_file, "rt") as stream:
    events = json.load(stream)["traceEvents"]
  intervals = {}
  for e in events:
    args = e.get("args", {})
    if e.get("ph") == "X" and "hlo_op" in args and "device_ordinal" in args:
      intervals.setdefault(args["device_ordinal"], []).append((e["ts"], e["ts"] + e["dur"]))
  assert len(intervals) == jax.device_count()
  union_us = 0.0
  for spans in intervals.values():
    end = float("-inf")
    for start, stop in sorted(spans):
      union_us += max(0.0, stop - max(start, end))
      end = max(end, stop)
  assert report["busy_ms"] == pytest.approx(union_us / 1e3 / STEPS / len(intervals), rel=1e-6)
  # The trace holds exactly the traced steps: one execution per step and device.
  assert set(report["executions_seen"].values()) == {STEPS}


def test_report_files_hold_the_table_and_the_environment(profiled):
  stem, report, _ = profiled
  table = stem.with_suffix(".md").read_text()
  for category in (*sp.CATEGORIES, sp.IDLE):
    row = report["rows"][category]
    assert f"| {category} | {ps._ms(row['ms'])} | {row['share']:.1%} |" in table
  assert stem.name == f"profile-tiny-{jax.devices()[0].device_kind.lower().replace(' ', '-')}-" \
      f"{jax.device_count()}dev"
  assert report["environment"]["device_count"] == jax.device_count()
  assert report["environment"]["jax"] == jax.__version__
  # the digest benchmarks/index.py --trace matches against commits' sources
  assert report["environment"]["source_digest"] == common.source_digest()
  assert report["overrides"][-1] == "model.remat_blocks=true"
  assert report["steps"] == STEPS and report["untraced_step_ms"] > 0
  top = [op["ms"] for op in report["top_ops"]]
  assert 0 < len(top) <= sp.TOP_OPS and top == sorted(top, reverse=True)
