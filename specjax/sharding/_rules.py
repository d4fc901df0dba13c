"""Logical-axis rules and per-model plans: which dimension of which array goes on which mesh axis."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from specjax.models import quant
from specjax.models.config import Config

MESH_AXES = ("data", "model")
ATTENTION = ("auto", "replicate", "pad")  # "auto": shard heads when H and G divide the model axes
DRAFT = ("shard", "replicate")

MeshAxes = Any  # a mesh axis name, a tuple of names, or None (replicated)

# Logical axes of every parameter, by its path in the tree (`llama.Transformer`'s docstring).
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("embed", "vocab"),  # [D, V]: the tied head's layout
    "lm_head": ("embed", "vocab"),
    "final_norm/scale": ("embed",),
    "layers/attn_norm/scale": ("layers", "embed"),
    "layers/mlp_norm/scale": ("layers", "embed"),
    "layers/wq": ("layers", "embed", "heads", "head_dim"),
    "layers/wk": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/wv": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/bq": ("layers", "heads", "head_dim"),
    "layers/bk": ("layers", "kv_heads", "head_dim"),
    "layers/bv": ("layers", "kv_heads", "head_dim"),
    "layers/wo": ("layers", "heads", "head_dim", "embed"),
    "layers/w_gate": ("layers", "embed", "mlp"),
    "layers/w_up": ("layers", "embed", "mlp"),
    "layers/w_down": ("layers", "mlp", "embed"),
}
CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")  # KVCache.k / .v
LOGITS_AXES = ("batch", None, "vocab")  # [B, T, V]
ROWS_AXES = ("batch", None)  # per-row buffers [B, S]


def _names(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (a name, a tuple of names, or None for replicated)."""

    batch: MeshAxes = "data"
    layers: MeshAxes = None
    embed: MeshAxes = None
    heads: MeshAxes = "model"
    kv_heads: MeshAxes = "model"
    head_dim: MeshAxes = None
    mlp: MeshAxes = "model"
    vocab: MeshAxes = "model"
    seq: MeshAxes = None

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        if not hasattr(self, logical) or logical.startswith("_"):
            raise ValueError(f"unknown logical axis {logical!r}; known: "
                             f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return _names(getattr(self, logical))

    def spec(self, logical: Sequence[str | None]) -> P:
        """The PartitionSpec of an array whose dimensions are `logical`; refuses collisions."""
        used: dict[str, str] = {}
        entries = []
        for name in logical:
            axes = self.mesh_axes(name)
            for a in axes:
                if a in used:
                    raise ValueError(f"sharding rules map logical axes {used[a]!r} and {name!r} of one array "
                                     f"{tuple(logical)} to the same mesh axis {a!r}")
                used[a] = name
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*entries)

    def check(self, mesh: Mesh) -> None:
        """Every mesh axis the rules name exists; no array of ours gets one mesh axis twice."""
        for f in dataclasses.fields(self):
            for a in _names(getattr(self, f.name)):
                if a not in mesh.shape:
                    raise ValueError(f"sharding rule {f.name} -> {a!r}: the mesh has no axis {a!r} "
                                     f"(its axes are {tuple(mesh.axis_names)})")
        for axes in (*PARAM_AXES.values(), CACHE_AXES, LOGITS_AXES):
            self.spec(axes)

    def size(self, mesh: Mesh, logical: str) -> int:
        return math.prod(mesh.shape[a] for a in self.mesh_axes(logical))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """What `Engine(mesh=...)` accepts besides a bare Mesh.

    attention: "auto" shards the heads over the model axis when both H and G divide
    it, else replicates the attention; "replicate" always replicates it; "pad"
    appends zero heads until they divide (`pad_heads`: the same tokens, G'/G times
    the attention work, but the attention weights and the KV cache are split).
    draft: "shard" plans the draft model like the target; "replicate" keeps a full
    copy of it on every device (its cache still splits by batch over "data").
    """

    mesh: Mesh
    rules: ShardingRules = ShardingRules()
    attention: str = "auto"
    draft: str = "shard"

    @classmethod
    def of(cls, mesh) -> "MeshConfig":
        """Validates `mesh` (a Mesh or a MeshConfig) before anything compiles."""
        config = mesh if isinstance(mesh, MeshConfig) else cls(mesh)
        if not isinstance(config.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or a specjax.sharding.MeshConfig, "
                            f"got {type(config.mesh).__name__}")
        if set(config.mesh.axis_names) != set(MESH_AXES) or len(config.mesh.axis_names) != 2:
            raise ValueError(f"mesh axes must be ('data', 'model'), got {tuple(config.mesh.axis_names)}; "
                             "e.g. jax.make_mesh((1, n), ('data', 'model')) for tensor parallelism only")
        if config.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {config.attention!r}")
        if config.draft not in DRAFT:
            raise ValueError(f"draft must be one of {DRAFT}, got {config.draft!r}")
        config.rules.check(config.mesh)
        return config


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axes with Auto axis types: GSPMD partitions the program."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


# --- per-model plan -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """The rules as they apply to one model (after its divisibility fallbacks)."""

    rules: ShardingRules
    notes: tuple[str, ...] = ()  # what was replicated and why

    @property
    def attention_sharded(self) -> bool:
        return bool(self.rules.mesh_axes("heads"))


def plan_model(config: Config, mesh: Mesh, rules: ShardingRules = ShardingRules(), attention: str = "auto",
               replicate: bool = False, what: str = "model") -> ModelPlan:
    """Adapts `rules` to `config` on `mesh`: replicates what does not divide its mesh axes.

    replicate: every parameter replicated (only the batch axis keeps its rule).
    """
    if replicate:
        return ModelPlan(dataclasses.replace(rules, layers=None, embed=None, heads=None, kv_heads=None,
                                             head_dim=None, mlp=None, vocab=None, seq=None),
                         (f"{what}: replicated on every device",))
    notes, changes = [], {}
    H, G = config.num_heads, config.num_kv_heads
    nh, ng = rules.size(mesh, "heads"), rules.size(mesh, "kv_heads")
    if attention == "replicate":
        changes.update(heads=None, kv_heads=None)
        notes.append(f"{what}: attention replicated (attention='replicate')")
    elif attention == "pad" and not (H % nh or G % ng):
        notes.append(f"{what}: attention sharded over {H} heads / {G} kv heads (zero heads padded where needed)")
    elif H % nh or G % ng:
        changes.update(heads=None, kv_heads=None)
        notes.append(f"{what}: {H} heads / {G} kv heads do not divide the model axis ({nh}/{ng}): "
                     "attention replicated, MLP and vocabulary stay sharded")
    for logical, size in (("mlp", config.intermediate_size), ("vocab", config.vocab_size),
                          ("embed", config.hidden_size), ("layers", config.num_layers),
                          ("head_dim", config.head_dim)):
        n = rules.size(mesh, logical)
        if size % n:
            changes[logical] = None
            notes.append(f"{what}: {logical} ({size}) does not divide its mesh axes ({n}): replicated")
    return ModelPlan(dataclasses.replace(rules, **changes), tuple(notes))


def _path(keys) -> str:
    parts = []
    for k in keys:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(k))
    return "/".join(parts)


def fit_spec(spec_entries, shape, mesh: Mesh):
    """Replicates any dimension whose size its mesh axes do not divide."""
    out = []
    for entry, size in zip(spec_entries, shape):
        n = math.prod(mesh.shape[a] for a in _names(entry))
        out.append(entry if size % n == 0 else None)
    return P(*out)


def _quant_specs(w: quant.BlockQuant, logical, rules: ShardingRules, mesh: Mesh):
    """Specs of a BlockQuant's codes [L, in/bs, bs, out] and scale/offset [L, in/bs, 1, out].

    The logical weight is [L, *in, *out] (flattened to in and out inside the blocks): the
    block axis carries the first input dimension's rule, the last axis the first output
    dimension's, provided the rest of each group is replicated.
    """
    lead, per_layer = logical[:-len(w.shape)], logical[-len(w.shape):]
    n_in = w.codes.shape[-3] * w.codes.shape[-2]
    split = next((i for i in range(1, len(w.shape)) if math.prod(w.shape[:i]) == n_in), None)
    if split is None:
        raise ValueError(f"block-quantized weight of shape {w.shape} does not split into {n_in} inputs")
    full = rules.spec((*lead, *per_layer))
    lead_spec, groups = tuple(full[:len(lead)]), (tuple(full[len(lead):len(lead) + split]),
                                                  tuple(full[len(lead) + split:]))
    firsts = []
    for group, dims in zip(groups, (w.shape[:split], w.shape[split:])):
        first = group[0] if all(e is None for e in group[1:]) else None
        n = math.prod(mesh.shape[a] for a in _names(first))
        firsts.append(first if dims[0] % n == 0 else None)
    spec = fit_spec((*lead_spec, firsts[0], None, firsts[1]), w.codes.shape, mesh)
    side = fit_spec((*lead_spec, firsts[0], None, firsts[1]), w.scale.shape, mesh)
    return quant.BlockQuant(spec, side, None if w.offset is None else side, w.shape)


def param_specs(params, plan: ModelPlan, mesh: Mesh):
    """A PartitionSpec for every array of `params` (BlockQuant leaves get a BlockQuant of specs)."""
    is_quant = lambda x: isinstance(x, quant.BlockQuant)  # noqa: E731

    def one(keys, x):
        path = _path(keys)
        if path not in PARAM_AXES:
            raise ValueError(f"no sharding rule for parameter {path!r} (known: {', '.join(PARAM_AXES)})")
        logical = PARAM_AXES[path]
        if is_quant(x):
            return _quant_specs(x, logical, plan.rules, mesh)
        if len(logical) != len(x.shape):
            raise ValueError(f"parameter {path!r} has shape {tuple(x.shape)}, expected axes {logical}")
        return fit_spec(plan.rules.spec(logical), x.shape, mesh)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quant)
