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
# "auto": shard the heads when H and G divide the model axis, else repeat the KV heads where that
# places them (wide tensor parallelism: more chips than KV heads), else replicate the attention
ATTENTION = ("auto", "replicate", "pad", "repeat_kv")
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
BRIDGE = "bridge"  # the key of a cross-vocabulary draft's tables in its params (specjax.cross_draft)
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
    it, else repeats the KV heads where that places them (as "repeat_kv"), else
    replicates the attention; "replicate" always replicates it; "pad" appends zero
    heads until they divide (`pad_heads`: the same tokens, G'/G times the attention
    work, but the attention weights and the KV cache are split); "repeat_kv" gives
    each chip H/TP query heads and a copy of the KV head they read when the model
    axis TP is wider than G (`repeat_kv_heads`; an error where H does not allow it).
    draft: "shard" plans the draft model like the target; "replicate" keeps a full
    copy of it on every device (its cache still splits by batch over "data").
    fsdp: the target's weights also split their embedding dimension over the batch
    axes ("data"), FSDP-style: each device stores 1/DATA of its tensor-parallel shard
    and the program gathers a layer's weights where it uses them, so every target
    forward pass moves (DATA-1)/DATA of the model's per-chip shard over the data axis
    (docs/wide_tp.md). For a target that does not fit on tensor parallelism alone;
    the draft (run K times per round) is never split so.
    """

    mesh: Mesh
    rules: ShardingRules = ShardingRules()
    attention: str = "auto"
    draft: str = "shard"
    fsdp: bool = False

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
        if not isinstance(config.fsdp, bool):
            raise TypeError(f"fsdp must be True or False, got {config.fsdp!r}")
        if config.fsdp and not config.rules.mesh_axes("batch"):
            raise ValueError("fsdp=True splits the weights over the batch axes, but the rules map 'batch' to none")
        config.rules.check(config.mesh)
        return config


def needs_preparing(mesh_config: MeshConfig) -> bool:
    """Whether `prepare_model` may change a model: padded heads under attention="pad", repeated KV
    heads under "repeat_kv" (and under "auto" where that places the attention)."""
    return not (mesh_config.attention in ("auto", "replicate") and not _wide(mesh_config))


def _wide(mesh_config: MeshConfig) -> bool:
    """"auto" may repeat KV heads: heads and KV heads share their mesh axes (the default rules)."""
    rules = mesh_config.rules
    return (mesh_config.attention == "auto" and bool(rules.mesh_axes("heads"))
            and rules.mesh_axes("heads") == rules.mesh_axes("kv_heads"))


def prepare_model(mesh_config: MeshConfig, model, what: str):
    """`model` as the engine runs it on this mesh (see `needs_preparing`); `what` names it in errors.
    Raises ValueError, before anything compiles, for heads that attention="repeat_kv" cannot place."""
    from specjax.sharding._pad import pad_heads, repeat_kv_heads, repeated_kv_heads

    mesh, rules = mesh_config.mesh, mesh_config.rules
    nh, ng = rules.size(mesh, "heads"), rules.size(mesh, "kv_heads")
    if mesh_config.attention == "pad":
        return pad_heads(model, math.lcm(nh, ng))
    c = model.config
    if mesh_config.attention == "repeat_kv":
        if rules.mesh_axes("heads") != rules.mesh_axes("kv_heads"):
            raise ValueError(f"attention='repeat_kv' needs heads and kv_heads on the same mesh axes, got "
                             f"{rules.heads!r} and {rules.kv_heads!r}")
        if repeated_kv_heads(c, nh) == c.num_kv_heads:  # nothing to repeat (or repeated already: models.load(mesh=))
            return model
        if _spans_processes(model.params):
            raise ValueError(f"attention='repeat_kv': the {what}'s parameters were placed across processes with "
                             f"{c.num_kv_heads} KV heads, which cannot be repeated where they lie; load it with "
                             "models.load(..., mesh=) on this mesh (which reads them repeated) or without mesh=")
        return repeat_kv_heads(model, nh)
    # "auto": only where the heads do not divide as they are and repeating places them
    if (c.num_heads % nh == 0 and c.num_kv_heads % ng == 0) or repeated_kv_heads(c, nh) is None:
        return model
    if _spans_processes(model.params):  # placed across processes unrepeated: its plan replicates the attention
        return model
    return repeat_kv_heads(model, nh)


def _spans_processes(params) -> bool:
    return any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in jax.tree.leaves(params))


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
               replicate: bool = False, what: str = "model", fsdp: bool = False) -> ModelPlan:
    """Adapts `rules` to `config` on `mesh`: replicates what does not divide its mesh axes.

    replicate: every parameter replicated (only the batch axis keeps its rule).
    fsdp: the embedding dimension of every weight goes on the batch axes too (`MeshConfig.fsdp`);
    no activation, cache or logit has that logical axis, so only the parameters change.
    """
    if replicate:
        return ModelPlan(dataclasses.replace(rules, layers=None, embed=None, heads=None, kv_heads=None,
                                             head_dim=None, mlp=None, vocab=None, seq=None),
                         (f"{what}: replicated on every device",))
    notes, changes = [], {}
    if fsdp and rules.size(mesh, "batch") > 1:
        rules = dataclasses.replace(rules, embed=rules.batch)
        notes.append(f"{what}: weights also split over {rules.batch!r} by their embedding dimension (fsdp): "
                     "each layer's are gathered where it runs")
    H, G = config.num_heads, config.num_kv_heads
    nh, ng = rules.size(mesh, "heads"), rules.size(mesh, "kv_heads")
    if attention == "replicate":
        changes.update(heads=None, kv_heads=None)
        notes.append(f"{what}: attention replicated (attention='replicate')")
    elif attention == "pad" and not (H % nh or G % ng):
        notes.append(f"{what}: attention sharded over {H} heads / {G} kv heads (zero heads padded where needed)")
    elif H % nh or G % ng:
        if attention == "repeat_kv":  # prepare_model repeats them; a config it did not prepare is refused
            raise ValueError(f"{what}: attention='repeat_kv' but {H} heads / {G} KV heads do not divide the model "
                             f"axis ({nh}): its KV heads must be repeated first (sharding.prepare_model, which Engine "
                             "and models.load(mesh=) apply)")
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
        if path.startswith(BRIDGE + "/"):  # a cross-vocabulary draft's translation tables: on every device
            return P()
        if path not in PARAM_AXES:
            raise ValueError(f"no sharding rule for parameter {path!r} (known: {', '.join(PARAM_AXES)})")
        logical = PARAM_AXES[path]
        if is_quant(x):
            return _quant_specs(x, logical, plan.rules, mesh)
        if len(logical) != len(x.shape):
            raise ValueError(f"parameter {path!r} has shape {tuple(x.shape)}, expected axes {logical}")
        return fit_spec(plan.rules.spec(logical), x.shape, mesh)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quant)
