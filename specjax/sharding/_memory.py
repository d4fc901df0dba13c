"""Memory accounting: bytes of parameters and KV caches on each device of a mesh."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax.models import llama


def _leaves_with_shardings(tree, shardings=None):
    leaves = jax.tree.leaves(tree)
    if shardings is None:  # host arrays count as one device's (jit puts them on the default device)
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return [(x, getattr(x, "sharding", None) or one) for x in leaves]  # an unplaced ShapeDtypeStruct: one
    return list(zip(leaves, jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))))


def bytes_per_device(tree, shardings=None) -> dict:
    """{device: bytes} that the arrays of `tree` occupy on each device of their mesh.

    `tree` holds placed jax.Arrays (their own shardings are read), or arrays /
    ShapeDtypeStructs with a matching tree of `shardings` (a plan, before placing).
    """
    out: dict = {}
    for x, sharding in _leaves_with_shardings(tree, shardings):
        itemsize = np.dtype(x.dtype).itemsize
        for device, index in sharding.devices_indices_map(tuple(x.shape)).items():
            shard = [len(range(*s.indices(n))) for s, n in zip(index, x.shape)]
            out[device] = out.get(device, 0) + int(np.prod(shard, dtype=np.int64)) * itemsize
    return out


def max_bytes_per_device(tree, shardings=None) -> int:
    per = bytes_per_device(tree, shardings)
    return max(per.values()) if per else 0


def memory_report(engine, batch_size: int, max_len: int | None = None) -> dict[str, int]:
    """Bytes per device (the most loaded one) of an engine's parameters and KV caches.

    batch_size and max_len (default: the engine's max_len, or 256) size the caches.
    Without a mesh, everything is on one device.
    """
    layout = getattr(engine, "layout", None)
    S = max_len or engine.max_len or 256
    t_cfg = engine.target.config
    caches = {"target_cache": (t_cfg, engine.target.dtype, "cache")}
    drafter = engine.drafter
    model = getattr(drafter, "model", drafter)
    d_cfg = getattr(model, "config", None)
    if d_cfg is not None:
        caches["draft_cache"] = (d_cfg, model.dtype, "draft_cache")
    report = {}
    draft = engine.params.draft
    if isinstance(draft, dict) and "embed" in draft and "net" in draft:  # a feature draft: the target's table, shared
        draft = {k: v for k, v in draft.items() if k != "embed"}
    for name, tree in (("target_params", engine.params.target), ("draft_params", draft)):
        report[name] = max_bytes_per_device(tree) if jax.tree.leaves(tree) else 0
    for name, (cfg, dtype, kind) in caches.items():
        # a draft of another vocabulary sizes its own cache (cross_draft: 1.25 x max_len)
        length = model.draft_len(S) if kind == "draft_cache" and hasattr(model, "draft_len") else S
        shapes = jax.eval_shape(lambda c=cfg, d=dtype, n=length: llama.init_cache(c, batch_size, n, d))
        if layout is None:
            report[name] = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(shapes))
            continue
        spec = layout.spec(kind, shapes.k.shape)
        shardings = llama.KVCache(layout.named(spec), layout.named(spec), layout.named(P(spec[1])))
        report[name] = max_bytes_per_device(shapes, shardings)
    report["total"] = sum(report.values())
    return report
