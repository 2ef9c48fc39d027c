"""Where the layer's arrays live: the ambient mesh, and moving tokens onto
and off the layer's batch sharding whatever the mesh's axis types.

A mesh from ``jax.make_mesh`` has Explicit axes (shardings are part of the
array types, and ``shard_map`` insists its inputs already match its
in_specs); one from ``jax.sharding.Mesh`` has Auto axes (XLA propagates
shardings, constraints are hints). The layer accepts tokens of any leading
shape and sharding on either, so the reshapes, padding and resharding live
here, once.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

try:  # private, but the only way to read the concrete ambient mesh inside jit
  from jax._src.mesh import get_concrete_mesh as _get_concrete_mesh
except ImportError:  # pragma: no cover - future JAX
  _get_concrete_mesh = None


def ambient_mesh() -> jax.sharding.Mesh | None:
  """The concrete mesh set by ``jax.set_mesh``, or None (also inside jit)."""
  mesh = None
  if _get_concrete_mesh is not None:
    mesh = _get_concrete_mesh()
  else:
    with contextlib.suppress(ValueError):  # get_mesh refuses inside jit
      mesh = jax.sharding.get_mesh()
  if mesh is None or getattr(mesh, "empty", True):
    return None
  return mesh


def legacy_mesh() -> jax.sharding.Mesh | None:
  """The mesh of a legacy ``with mesh:`` block (deprecated in JAX, not read
  by ``jax.sharding.get_mesh``), or None."""
  try:
    from jax._src.mesh import thread_resources  # noqa: PLC0415 - private, read only
  except ImportError:  # pragma: no cover - a JAX without the legacy context
    return None
  mesh = thread_resources.env.physical_mesh
  return None if getattr(mesh, "empty", True) else mesh


def input_mesh(x):
  """The mesh ``x`` is sharded over, where its sharding says: a concrete
  array's ``NamedSharding``, or a traced array's type on Explicit axes; None
  otherwise (a NumPy array, one device, a tracer on Auto axes)."""
  if isinstance(x, jax.core.Tracer):
    spec_sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(spec_sharding, "mesh", None)
    return None if mesh is None or getattr(mesh, "empty", True) or not is_explicit(mesh) else mesh
  if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
    return x.sharding.mesh
  return None


def is_explicit(mesh) -> bool:
  """Whether any axis of ``mesh`` is Explicit (shardings live in the types)."""
  explicit = jax.sharding.AxisType.Explicit
  return any(axis_type == explicit for axis_type in getattr(mesh, "axis_types", ()))


def replicated(value: jax.Array, mesh) -> jax.Array:
  """``value`` placed whole on every device of ``mesh`` (None: unchanged)."""
  if mesh is None:
    return value
  return jax.device_put(value, NamedSharding(mesh, P()))


def _on_mesh(mesh, fn, out_spec, *args):
  """``fn(*args)`` with its output sharded ``out_spec`` over ``mesh``: a
  constraint on Auto axes; computed with the axes made Auto, then placed, on
  Explicit ones (so reshapes of sharded dimensions are the partitioner's job,
  not an error)."""
  if not is_explicit(mesh):
    return jax.lax.with_sharding_constraint(fn(*args), NamedSharding(mesh, out_spec))
  context = (contextlib.nullcontext() if jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
             else jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
  with context:
    return jax.sharding.auto_axes(fn, out_sharding=out_spec)(*args)


def place(value: jax.Array, mesh, spec: P) -> jax.Array:
  """``value`` sharded ``spec`` over ``mesh`` (what ``shard_map`` in_specs want)."""
  return _on_mesh(mesh, lambda v: v, spec, value)


def token_rows(x: jax.Array, rows: int, mesh, batch_axes: tuple[str, ...]) -> jax.Array:
  """``x [..., H]`` -> ``[rows, H]``: flattened, zero rows appended, and (with a
  mesh) split over ``batch_axes`` on the first axis."""
  hidden = x.shape[-1]
  count = math.prod(x.shape[:-1])

  def flatten(x):
    return jnp.pad(x.reshape(count, hidden), ((0, rows - count), (0, 0)))

  if mesh is None:
    return flatten(x)
  return _on_mesh(mesh, flatten, P(batch_axes, None), x)


def _type_spec(x: jax.Array):
  """The spec of ``x``'s type-level sharding on Explicit axes, else None."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True) or not is_explicit(mesh):
    return None
  return sharding.spec


def like_input(rows: jax.Array, x: jax.Array, mesh) -> jax.Array:
  """Inverse of :func:`token_rows`: the first ``prod(x.shape[:-1])`` rows in
  ``x``'s shape and dtype, and on Explicit axes with ``x``'s sharding
  (replicated where ``x``'s type carries none; on Auto axes XLA propagates
  it)."""
  count = math.prod(x.shape[:-1])

  def unflatten(rows):
    return rows[:count].reshape(x.shape).astype(x.dtype)

  if mesh is None or not is_explicit(mesh):
    return unflatten(rows)
  # x without a sharding in its type (a NumPy array, or one made outside the
  # mesh) is whole on every device: so is y.
  spec = _type_spec(x)
  return _on_mesh(mesh, unflatten, P() if spec is None else spec, rows)


def varying_axes(x) -> frozenset:
  """The ``shard_map`` axes ``x`` varies over (``aval.mat.varying`` in newer
  JAX, ``aval.vma`` in older); empty outside ``shard_map``."""
  aval = jax.typeof(x)
  manual_axis_type = getattr(aval, "mat", None)
  if manual_axis_type is not None:
    return frozenset(manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def vary_like(x: jax.Array, *others: jax.Array, also=frozenset()) -> jax.Array:
  """``x`` marked varying over every ``shard_map`` axis that any of ``others``
  varies over (and ``also``): what a custom rule or a kernel call needs where
  its inputs mix replicated and varying values (its transpose sums over the
  added axes), or where a kernel call dropped its outputs' axes."""
  wanted = frozenset(also).union(*(varying_axes(o) for o in others))
  missing = wanted - varying_axes(x)
  if not missing:
    return x
  return jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")
