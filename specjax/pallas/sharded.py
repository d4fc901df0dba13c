"""Gate statistics of vocabulary-sharded logits, without gathering the logits.

Each device holds logits [rows, V / Y] (Y = size of `vocab_axis`). Inside
`jax.shard_map` it computes the partial statistics of its slice (kernel or jnp),
shifts its argmax to global indices, and the devices exchange those partials
(8 floats per row) with one `all_gather` over `vocab_axis`. Every device then
combines the Y partials in vocabulary order (max, rescaled sum-exp and
shifted sum, lowest-index argmax, top-3 merge, the one shard's token logit)
and finalises, so the result is replicated over `vocab_axis` and the full
[rows, V] logits never exist on one device.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax.backend import Backend
from specjax.pallas import _dispatch, _online
from specjax.pallas._online import GatePartials, GateStats
from specjax.pallas.gate_stats import check_inputs, gate_partials

__all__ = ["gate_stats_sharded"]


def _axis_size(mesh: Mesh, axis) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    for name in names:
        if name not in mesh.shape:
            raise ValueError(f"mesh has no axis {name!r}; its axes are {tuple(mesh.shape)}")
    return math.prod(mesh.shape[name] for name in names)


def _constrain(a, mesh: Mesh, spec: P):
    """Places `a` as `spec` on `mesh`: `jax.reshard` on Explicit axes, a constraint on Auto ones.

    On a mesh with Explicit axes an array whose type already carries `spec` is left
    alone: besides saving a no-op, this keeps the function usable under `jax.vmap`,
    whose batching of a reshard or constraint leaves the new axis unconstrained,
    which Explicit axes refuse.
    """
    names = [n for entry in spec if entry is not None
             for n in (entry if isinstance(entry, tuple) else (entry,))]
    sharding = NamedSharding(mesh, spec)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if AxisType.Explicit in types.values() and _spec_of(a) == _padded(tuple(spec), len(a.shape)):
        return a
    if any(types[n] == AxisType.Explicit for n in names):
        return jax.reshard(a, sharding)
    return lax.with_sharding_constraint(a, sharding)


def _padded(spec: tuple, rank: int) -> tuple:
    return spec + (None,) * (rank - len(spec))


def _spec_of(a) -> tuple:
    """The PartitionSpec in `a`'s type (all None unless sharded on Explicit axes), padded."""
    spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", None)
    return _padded(tuple(spec or ()), len(a.shape))


def _pack(p: GatePartials):
    cols = [p.max, p.sum_exp, p.sum_exp_shift, p.top3[:, 0], p.top3[:, 1], p.top3[:, 2],
            p.argmax.astype(jnp.float32), p.token_logit]
    return jnp.stack(cols, axis=-1)  # [n, 8]; indices < 2**24 are exact in float32


def _unpack(a) -> GatePartials:
    return GatePartials(a[..., 0], a[..., 1], a[..., 2], a[..., 3:6],
                        a[..., 6].astype(jnp.int32), a[..., 7])


def gate_stats_sharded(logits, tokens=None, *, mesh: Mesh, vocab_axis, row_axis=None,
                       impl=None, interpret=None, variant=None, block_v=None,
                       block_n=None, num_splits=None, backend=None, checked=False) -> GateStats:
    """`gate_stats` of logits [..., V] sharded over V on `mesh` axis `vocab_axis`.

    V must divide evenly over `vocab_axis`. row_axis: mesh axis (or axes) the flattened
    rows are sharded on (None: rows replicated); M must divide evenly over it. The
    result is sharded over `row_axis` and replicated over `vocab_axis`. impl: None
    (kernel on GPU/TPU, jnp partials on CPU), "kernel" or "reference"; the other
    options are those of `gate_stats` (backend: its pallas impl and platform; checked: the caller
    validated the inputs).
    """
    if not checked:
        check_inputs(logits, tokens)
    *lead, V = logits.shape
    lead = tuple(lead)
    M = int(np.prod(lead, dtype=np.int64))
    Y = _axis_size(mesh, vocab_axis)
    if V % Y:
        raise ValueError(f"vocabulary size {V} does not divide over mesh axis {vocab_axis!r} "
                         f"of size {Y}; pad the vocabulary (with -inf logits) to a multiple of {Y}")
    if row_axis is not None:
        row_shards = _axis_size(mesh, row_axis)
        if M % row_shards:
            raise ValueError(f"{M} rows do not divide over mesh axis {row_axis!r} of size {row_shards}")
    impl = _dispatch.resolve_impl(impl, backend)
    platform = None if backend is None else backend.platform
    if tokens is None:
        tokens = jnp.full(lead, -1, jnp.int32)
        has_tokens = False
    else:
        has_tokens = True
    return _sharded(logits, tokens, mesh=mesh, vocab_axis=vocab_axis, row_axis=row_axis,
                    has_tokens=has_tokens, impl=impl, interpret=interpret, variant=variant,
                    block_v=block_v, block_n=block_n, num_splits=num_splits, platform=platform)


@functools.partial(jax.jit, static_argnames=(
    "mesh", "vocab_axis", "row_axis", "has_tokens", "impl", "interpret", "variant",
    "block_v", "block_n", "num_splits", "platform"))
def _sharded(logits, tokens, *, mesh, vocab_axis, row_axis, has_tokens, impl, interpret,
             variant, block_v, block_n, num_splits, platform):
    *lead, V = logits.shape
    M = math.prod(lead)
    x = jnp.reshape(logits, (M, V))
    tok = jnp.reshape(tokens, (M,)).astype(jnp.int32)

    def local(x_nxv, tok_n):
        v_local = x_nxv.shape[1]
        offset = lax.axis_index(vocab_axis) * v_local
        # A token outside this shard maps outside [0, v_local) and contributes 0.
        tok_local = jnp.where(tok_n >= 0, tok_n - offset, -1)
        # inside the shard_map the kernel is not wrapped again: only the platform carries over
        p = gate_partials(x_nxv, tok_local, impl=impl, interpret=interpret, variant=variant,
                          block_v=block_v, block_n=block_n, num_splits=num_splits,
                          backend=None if platform is None else Backend(platform=platform))
        p = p._replace(argmax=p.argmax + offset)
        # [Y, n, 8] in vocabulary order, the same (invariant) on every device of the axis
        gathered = lax.all_gather(_pack(p), vocab_axis, to="invarying")
        combined = _online.combine_partials(_unpack(gathered))
        return _online.finalize(combined, V, tok_n if has_tokens else None)

    # The Pallas interpreter trips over varying-manual-axes checks inside shard_map
    # (jax 0.10: "Primitive eq requires varying manual axes to match"), so the kernel
    # path runs unchecked; its output is replicated over vocab_axis by construction
    # (an invariant all_gather followed by the same arithmetic on every device).
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(row_axis, vocab_axis), P(row_axis)),
                       out_specs=P(row_axis), check_vma=(impl == "reference"))
    stats = fn(_constrain(x, mesh, P(row_axis, vocab_axis)), _constrain(tok, mesh, P(row_axis)))
    return GateStats(*(jnp.reshape(a, lead) for a in stats))
