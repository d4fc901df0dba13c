"""Placing a generation on a device mesh with axes ("data", "model").

A table of logical-axis rules (`ShardingRules`) maps the names of array
dimensions to mesh axes, as jax-llm-examples' llama3 does:

    batch -> "data"        (data parallelism: rows, caches and logits split by row)
    heads, kv_heads, mlp, vocab -> "model"   (tensor parallelism)
    layers, embed, head_dim, seq -> None     (replicated)

and refuses a table that would put one mesh axis on two dimensions of one
array. `plan_model` adapts the table to a model: the attention is tensor-
parallel where both the query heads H and the KV heads G divide the model axis
TP. Where TP is wider than G (Llama-3.1-70B's 8 KV heads on 16 chips),
`prepare_model` repeats each KV head for the chips whose query heads read it
(`repeat_kv_heads`, wide tensor parallelism: H/TP query heads and one KV head
per chip; `attention="auto"` or `"repeat_kv"`, docs/wide_tp.md). Where neither
works (SmolLM2's 9/3 heads on 2, 4 or 8) `"auto"` replicates the attention
weights and the KV cache's head axis while the MLP and the vocabulary stay
sharded, or (`attention="pad"`) `pad_heads` appends zero heads until they
divide. Every way the tokens stay those of one device. Any other dimension that
does not divide its mesh axes is replicated too. `MeshConfig(fsdp=True)` also
splits the target's weights over "data" (gathered per layer in the program).

`make_layout` builds the `Layout` the engine compiles with: `NamedSharding`s of
the parameters (float arrays and block-quantized `quant.BlockQuant` leaves),
the KV caches [L, B, S, G, Dh] and the logits [B, T, V], the sharding
constraints the program applies to its carried state, and the
`verify.VocabSharding` through which the rules reduce vocabulary-sharded
logits per shard (so the [B, K+1, V] logits are never gathered on one device).

Memory accounting: `bytes_per_device` of any placed or planned pytree, and
`memory_report(engine, batch_size)` for the parameters and caches of a run.

The program is partitioned by GSPMD: the engine rebuilds the mesh with Auto
axis types (`jax.make_mesh` now makes Explicit ones), places the inputs, and
constrains caches and logits; XLA inserts the collectives. Multi-process runs
(`jax.distributed`) use the same code: inputs are built with
`jax.make_array_from_callback`, and the outputs are replicated so that every
process reads them.

Modules: `_rules` (the table, MeshConfig, per-model plans and parameter specs),
`_layout` (Layout, placing arrays), `_memory` (bytes per device), `_pad` (zero heads,
repeated KV heads).
"""

from specjax.sharding._layout import Layout, describe, make_layout, place
from specjax.sharding._memory import bytes_per_device, max_bytes_per_device, memory_report
from specjax.sharding._pad import pad_heads, padded_counts, repeat_kv_heads, repeated_kv_heads
from specjax.sharding._rules import ATTENTION, CACHE_AXES, DRAFT, LOGITS_AXES, MESH_AXES, PARAM_AXES, ROWS_AXES
from specjax.sharding._rules import MeshConfig, ModelPlan, ShardingRules
from specjax.sharding._rules import auto_mesh, fit_spec, needs_preparing, param_specs, plan_model, prepare_model

__all__ = [
    "ATTENTION", "CACHE_AXES", "DRAFT", "LOGITS_AXES", "MESH_AXES", "PARAM_AXES", "ROWS_AXES",
    "Layout", "MeshConfig", "ModelPlan", "ShardingRules", "auto_mesh", "bytes_per_device", "describe",
    "fit_spec", "make_layout", "max_bytes_per_device", "memory_report", "pad_heads", "padded_counts",
    "param_specs", "place", "needs_preparing", "plan_model", "prepare_model", "repeat_kv_heads", "repeated_kv_heads",
]
