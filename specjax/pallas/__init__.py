"""Pallas kernels with pure-jnp references.

- `gate_stats`: one pass over [..., V] logits -> max, argmax, log-sum-exp, entropy
  (full, normalized, top-3) and a given token's logit (`GateStats`).
- `gate_stats_sharded`: the same for logits sharded over V on a mesh axis.
- `regret_prefix`: docs/rules.md's ASD cumulative-regret prefix selection for a batch.

`specjax.verify` reads every statistic its rules need through `gate_stats` (or
`gate_stats_sharded` when its backend has a `vocab_sharding`), and ASD's prefix
selection is `regret_prefix`.

Each dispatches (see `_dispatch`) to the compiled kernel on GPU/TPU and to its jnp
reference on CPU (for the gate statistics, the kernel's own algebra in jnp; the rules
themselves compute the plain statistics on CPU without this package, and call the kernel
where their backend says "kernel"); `impl="kernel"`, `backend=Backend(pallas="kernel")` or
`SPECJAX_PALLAS=kernel` forces the kernel (interpret mode on CPU). With
`backend=Backend(platform="tpu")`, or a mesh of TPU devices in context, a CPU host
traces the compiled Mosaic variant (for deviceless AOT compilation to a TPU topology).
With `backend.mesh` set, a kernel traced outside a shard_map runs in a replicated one
over it (the partitioner cannot split a Mosaic or Triton call).
"""

from specjax.pallas._dispatch import ENV_VAR, resolve_backend, resolve_impl, target_platform
from specjax.pallas.gate_stats import (GatePartials, GateStats, check_inputs, combine_partials,
                                       finalize_partials, gate_partials,
                                       gate_partials_reference, gate_stats,
                                       gate_stats_reference)
from specjax.pallas.regret_prefix import (RegretPrefix, regret_prefix,
                                          regret_prefix_reference, suffix_weights)
from specjax.pallas.sharded import gate_stats_sharded

__all__ = [
    "ENV_VAR", "resolve_backend", "resolve_impl", "target_platform",
    "GateStats", "GatePartials", "check_inputs", "gate_stats", "gate_stats_reference", "gate_partials",
    "gate_partials_reference", "combine_partials", "finalize_partials",
    "gate_stats_sharded",
    "RegretPrefix", "regret_prefix", "regret_prefix_reference", "suffix_weights",
]
