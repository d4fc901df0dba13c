"""The `Layout` a generation compiles with, and placing arrays on it (one or several processes)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import verify
from specjax.models import llama
from specjax.models.config import Config
from specjax.sharding._rules import CACHE_AXES, LOGITS_AXES, ROWS_AXES, MeshConfig, ModelPlan
from specjax.sharding._rules import auto_mesh, fit_spec, param_specs, plan_model


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shardings of one generation on a mesh (hashable: a static part of the program)."""

    mesh: Mesh  # Auto axis types
    target: ModelPlan
    draft: ModelPlan | None
    vocab_sharded: bool  # the target's logits are split over the vocabulary

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def data_size(self) -> int:
        return self.target.rules.size(self.mesh, "batch")

    def spec(self, kind: str, shape=None) -> P:
        """kind: cache (target), draft_cache, logits (target), rows ([B, ...] buffers)."""
        plan = self.draft if kind == "draft_cache" else self.target
        logical = {"cache": CACHE_AXES, "draft_cache": CACHE_AXES, "logits": LOGITS_AXES, "rows": ROWS_AXES}[kind]
        spec = plan.rules.spec(logical)
        return spec if shape is None else fit_spec(spec, shape, self.mesh)

    def constrain(self, kind: str, x):
        """`with_sharding_constraint` on an array, a KVCache, or a pytree holding KVCaches."""
        if isinstance(x, llama.KVCache):
            spec = self.spec(kind, x.k.shape)
            c = lambda a: jax.lax.with_sharding_constraint(a, self.named(spec))  # noqa: E731
            lengths = jax.lax.with_sharding_constraint(x.lengths, self.named(P(spec[1])))
            return llama.KVCache(c(x.k), c(x.v), lengths)
        if isinstance(x, jax.Array) or hasattr(x, "shape"):
            if kind == "draft_cache":  # a drafter's per-row arrays beside its cache ([B, ...]): split by row
                kind = "rows"
            return jax.lax.with_sharding_constraint(x, self.named(self.spec(kind, x.shape)))
        return jax.tree.map(lambda a: self.constrain(kind, a), x,
                            is_leaf=lambda a: isinstance(a, llama.KVCache))

    @property
    def vocab_sharding(self):
        """The `verify.VocabSharding` of the target logits, or None when they are not split."""
        if not self.vocab_sharded:
            return None
        axes = self.target.rules.mesh_axes("vocab")
        batch = self.target.rules.mesh_axes("batch")
        return verify.VocabSharding(self.mesh, axes[0] if len(axes) == 1 else axes,
                                    batch_axis=None if not batch or self.data_size == 1 else
                                    (batch[0] if len(batch) == 1 else batch))

    def param_shardings(self, params, which: str = "target"):
        plan = self.target if which == "target" else self.draft
        specs = param_specs(params, plan, self.mesh)
        return jax.tree.map(self.named, specs, is_leaf=lambda s: isinstance(s, P))

    @property
    def deviceless(self) -> bool:
        """The mesh describes chips this host does not run (a TPU topology, for AOT compilation):
        host-memory checks do not apply; the TPU compiler checks each chip's HBM."""
        return _deviceless(self.replicated)

    def check_batch(self, batch_size: int) -> None:
        n = self.data_size
        if batch_size % n:
            axes = self.target.rules.mesh_axes("batch")
            raise ValueError(f"batch of {batch_size} prompts does not divide over mesh axis "
                             f"{axes[0] if len(axes) == 1 else axes!r} of size {n}; pass a multiple of {n} "
                             "prompts (or a mesh with a smaller 'data' axis)")


def make_layout(mesh_config: MeshConfig, target: Config, draft: Config | None = None) -> Layout:
    mesh = auto_mesh(mesh_config.mesh)
    rules = mesh_config.rules
    t = plan_model(target, mesh, rules, mesh_config.attention, what="target", fsdp=mesh_config.fsdp)
    d = None
    if draft is not None:
        d = plan_model(draft, mesh, rules, mesh_config.attention, replicate=mesh_config.draft == "replicate",
                       what="draft")
    vocab_axes = t.rules.mesh_axes("vocab")
    vocab_sharded = bool(vocab_axes) and t.rules.size(mesh, "vocab") > 1
    return Layout(mesh, t, d, vocab_sharded)


# --- placing arrays -------------------------------------------------------------


def place(tree, shardings):
    """Puts host or device arrays at `shardings` (a matching tree of NamedShardings).

    With one process this is `jax.device_put` (nothing moves for an array already at its
    sharding). With several (`jax.distributed`), every process must hold the same full values
    (the same checkpoint or seed); each builds the shards of its own devices with
    `jax.make_array_from_callback`. Arrays that span processes already (`models.load(...,
    mesh=)`) are kept where they are at the same sharding, else resharded by `jax.device_put`.

    Nothing is transferred where there is nothing to hold: `jax.ShapeDtypeStruct`
    leaves (an abstract model) and any leaf bound for devices this host cannot
    address (a TPU topology described on a CPU host, for AOT compilation) become
    ShapeDtypeStructs carrying their sharding.
    """
    leaves = jax.tree.leaves(tree)
    shards = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves) or any(map(_deviceless, shards)):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x), sharding=s),
                            tree, shardings)
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # placed already (models.load(mesh=))
            return x if x.sharding.is_equivalent_to(sharding, x.ndim) else jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def _dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _deviceless(s: jax.sharding.Sharding) -> bool:
    """True for a sharding over devices that no backend of this host runs (topology descriptions)."""
    device = next(iter(s.device_set))
    try:
        return device not in jax.devices(device.platform)
    except RuntimeError:  # no backend for that platform here
        return True


def describe(layout: Layout | None) -> str:
    """One line per plan note, for logs."""
    if layout is None:
        return "one device"
    attn = "sharded" if layout.target.attention_sharded else "replicated"
    lines = [f"mesh {dict(layout.mesh.shape)}; attention {attn}"
             f"; vocabulary {'sharded' if layout.vocab_sharded else 'replicated'}"]
    lines += list(layout.target.notes) + (list(layout.draft.notes) if layout.draft else [])
    return "\n".join(lines)
