"""The call path from the layer to a kernel launch: every launch of the
layer's forward, on one rank and on the peer exchange, is at most ten frames
over six modules from ``ExpertParallelMoE.__call__``, and the first one is
the path ``moe_ep/transport/__init__.py``'s docstring states. The launches
are recorded on CPU where the CuPy kernels would be lowered (CuPy and peer
access reported, ``buffer_callback`` replaced by a recorder that returns
zeros): the program is traced, never run."""

import pathlib
import traceback

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import moe_ep
from conftest import make_mesh
from moe_ep import ExpertParallelMoE, MoEConfig
from moe_ep.transport import kernel_launch
from moe_ep.transport.peer import callback as peer_callback
from moe_ep.transport.peer import reachability

PACKAGE = pathlib.Path(moe_ep.__file__).parent
MAX_FRAMES, MAX_MODULES = 10, 6


def launch_paths(monkeypatch, mesh) -> list[list[traceback.FrameSummary]]:
  """The moe_ep frames from ``__call__`` to each ``buffer_callback`` of the
  layer's forward, in launch order."""
  paths = []

  def recording_buffer_callback(callback, result_shapes, **options):
    frames = traceback.extract_stack()[:-1]
    start = max(i for i, f in enumerate(frames)
                if f.name == "__call__" and f.filename == str(PACKAGE / "layer.py"))
    paths.append([f for f in frames[start:]
                  if pathlib.Path(f.filename).is_relative_to(PACKAGE)])
    return lambda *inputs: [jnp.zeros(s.shape, s.dtype) for s in result_shapes]

  monkeypatch.setattr(kernel_launch, "buffer_callback", recording_buffer_callback)
  monkeypatch.setattr(peer_callback, "buffer_callback", recording_buffer_callback)
  monkeypatch.setattr(kernel_launch, "cupy_available", lambda: True)
  monkeypatch.setattr(kernel_launch, "local_gpu_ordinals", lambda: [])
  monkeypatch.setattr(reachability, "unsupported_reason", lambda mesh, axis: None)
  layer = ExpertParallelMoE(MoEConfig(hidden_size=64, ffn_size=128, num_experts=4, top_k=2),
                            mesh=mesh, rngs=nnx.Rngs(0))
  jax.eval_shape(lambda x: layer(x), jnp.ones((2, 8, 64), jnp.bfloat16))
  return paths


def frame_name(frame: traceback.FrameSummary) -> str:
  module = pathlib.Path(frame.filename).relative_to(PACKAGE).with_suffix("")
  return ".".join(module.parts) + "." + frame.name


def stated_path() -> list[str]:
  """The frames of the call-path block in moe_ep/transport/__init__.py."""
  doc = moe_ep.transport.__doc__
  block = doc[doc.index("Call path"):].split("::\n\n", 1)[1]
  return [line.split()[0] for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("ep_size", [1, 2])  # one rank; two on the peer exchange
def test_every_launch_is_within_ten_frames_over_six_modules(monkeypatch, ep_size):
  mesh = make_mesh((ep_size,), ("ep",)) if ep_size > 1 else None
  paths = launch_paths(monkeypatch, mesh)
  assert len(paths) >= 4  # route, slab layout, the dispatch's and the combine's rows
  for path in paths:
    names = [frame_name(f) for f in path]
    assert len(path) <= MAX_FRAMES, names
    assert len({f.filename for f in path}) <= MAX_MODULES, names
  if ep_size > 1:  # the exchanges' fused launches are among them
    assert any(names[-1].endswith("peer.callback.fused_call")
               for names in ([frame_name(f) for f in p] for p in paths))


def test_the_docstring_states_the_first_launchs_path(monkeypatch):
  first = launch_paths(monkeypatch, None)[0]
  stated = [name.replace("ExpertParallelMoE.", "") for name in stated_path()]
  assert [frame_name(f) for f in first] == stated
