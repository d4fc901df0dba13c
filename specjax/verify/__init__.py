"""Acceptance rules (docs/rules.md): pure, jit-able, vmap-friendly functions.

Each rule verifies one sequence (draft_tokens int[K], target_logits [K+1, V]);
jax.vmap gives the batch. The rule objects (`Greedy()`, `Fly(theta=0.2)`, ...) hold a
rule's options and state and verify a batch; the engine takes them as its method.
Every rule reads the logits through `row_stats`: plain jnp statistics on CPU, the
fused `specjax.pallas` kernels where the backend says "kernel" (GPU/TPU). Every rule takes `backend=None`: a
`specjax.backend.Backend`, e.g. `Backend(vocab_sharding=VocabSharding(mesh))` for logits
sharded over the vocabulary on a mesh.
"""

from specjax.verify._asd import asd
from specjax.verify._common import RowStats, Verdict, VocabSharding, row_stats
from specjax.verify._csd import csd, csd_batch
from specjax.verify._csd_memory import (CSDMemory, check_vocab as check_csd_vocab, csd_count, csd_memory,
                                       is_saved_memory, load_csd_memory, save_csd_memory)
from specjax.verify._fly import fly
from specjax.verify._greedy import greedy
from specjax.verify._rules import (ALIASES, METHODS, RULES, Asd, Csd, Fly, Greedy, Round, RoundCounts, Rule,
                                   Sampling, Typical, at_temperature, rule)
from specjax.verify._sampling import speculative_sampling
from specjax.verify._typical import typical

__all__ = [
    "ALIASES",
    "Asd",
    "CSDMemory",
    "Csd",
    "Fly",
    "Greedy",
    "METHODS",
    "RULES",
    "Round",
    "RoundCounts",
    "Rule",
    "Sampling",
    "Typical",
    "RowStats",
    "Verdict",
    "VocabSharding",
    "asd",
    "at_temperature",
    "check_csd_vocab",
    "csd",
    "csd_batch",
    "csd_count",
    "csd_memory",
    "fly",
    "greedy",
    "is_saved_memory",
    "load_csd_memory",
    "row_stats",
    "rule",
    "save_csd_memory",
    "speculative_sampling",
    "typical",
]
