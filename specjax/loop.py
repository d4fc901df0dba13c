"""The compiled generation: prefill, then one `jax.lax.while_loop` over rounds.

    prompt -> prefill (first token) -> while any row is live: round -> tokens, stats

A speculative round reads top to bottom as the algorithm does:

    draft    K tokens per row (a draft model's scan, prompt lookup, ...)
    score    the target runs once on [pending, d_0 .. d_{K-1}] at each row's offset
    verify   the policy's rule gives n (accepted drafts) and the next token per row
    commit   each row emits d[:n] + [next] and moves its length pointer by n + 1

Target-only decoding is the same loop without a drafter: score the pending
token, emit the next one. Rejected positions are never erased: the length
pointers move, and attention masks by position.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.models import llama
from specjax.models.llama import KVCache


@dataclasses.dataclass(frozen=True)
class Settings:
    """Static, hashable generation settings (a jit static argument)."""

    max_new_tokens: int
    max_len: int
    temperature: float
    top_p: float
    eos_ids: tuple[int, ...]
    dtype: Any = jnp.float32
    layout: Any = None  # sharding.Layout on a mesh; None: one device (no constraints at all)


def _shard(s: Settings, kind: str, x):
    """Pins `x` (an array, a KVCache, or a drafter state) to the layout's sharding of `kind`."""
    return x if s.layout is None else s.layout.constrain(kind, x)


class LoopState(NamedTuple):
    """Everything the while_loop carries (one named pytree)."""

    cache: KVCache  # target cache; lengths[b] = L: row b's pending token sits at seq[b, L]
    seq_BS: jax.Array  # int32[B, max_len]: prompt then emitted tokens
    prompt_len_B: jax.Array  # int32[B]
    num_out_B: jax.Array  # int32[B]: emitted tokens; L = prompt_len + num_out - 1
    done_B: jax.Array  # bool[B]
    key: jax.Array
    draft_state: Any  # the drafter's own state (a draft KV cache, or ())
    policy_state: Any  # the rule's state (ASD ledgers, CSD memory, or ())
    stats: dict  # per-row and per-position counters (see `init_stats`)


def init_stats(B: int, K: int) -> dict:
    zi = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    return {
        "rounds_B": zi(B),  # verification forwards in which the row was live
        "round_tokens_B": zi(B),  # tokens emitted by rounds (the prefill token excluded)
        "accepted_K": zi(K),  # rounds (all rows) in which draft position i was accepted
        "offered_K": zi(K),  # rounds (all rows) in which draft position i was a real draft
        "num_loose_B": zi(B),  # mismatches a loose rule accepted
        "examined_B": zi(B),  # those plus the mismatches that stopped a round
        "spent_B": jnp.zeros((B,), jnp.float32),  # ASD ledger charged
    }


def commit(state: LoopState, block_BJ, count_B, advance_B, s: Settings) -> LoopState:
    """Emits `block_BJ[b, :count_B[b]]` for each live row and moves its cache pointer.

    The count is cut at `max_new_tokens` and just after the first EOS, so no row
    ever emits past either. `advance_B` is how many fed tokens the cache keeps
    (the pending token plus the accepted drafts); the last emitted token becomes
    the new pending one.
    """
    B, J = block_BJ.shape
    live_B = ~state.done_B
    j_J = jnp.arange(J, dtype=jnp.int32)
    count_B = jnp.minimum(count_B, s.max_new_tokens - state.num_out_B)
    if s.eos_ids:
        is_eos_BJ = jnp.isin(block_BJ, jnp.asarray(s.eos_ids, jnp.int32)) & (j_J[None] < count_B[:, None])
        first_eos_B = jnp.where(is_eos_BJ.any(-1), jnp.argmax(is_eos_BJ, axis=-1), J)
        hit_eos_B = first_eos_B < count_B
        count_B = jnp.minimum(count_B, first_eos_B + 1)
    else:
        hit_eos_B = jnp.zeros((B,), bool)
    count_B = jnp.where(live_B, count_B, 0)
    S = state.seq_BS.shape[1]
    pos_BJ = jnp.where(j_J[None] < count_B[:, None], (state.prompt_len_B + state.num_out_B)[:, None] + j_J[None], S)
    num_out_B = state.num_out_B + count_B
    stats = dict(state.stats)
    stats["rounds_B"] = stats["rounds_B"] + live_B
    stats["round_tokens_B"] = stats["round_tokens_B"] + count_B
    return state._replace(
        cache=state.cache._replace(lengths=state.cache.lengths + jnp.where(live_B, advance_B, 0)),
        seq_BS=state.seq_BS.at[jnp.arange(B)[:, None], pos_BJ].set(block_BJ, mode="drop"),
        num_out_B=num_out_B,
        done_B=state.done_B | (live_B & (hit_eos_B | (num_out_B >= s.max_new_tokens))),
        stats=stats,
    )


def pending(state: LoopState) -> jax.Array:
    return jnp.take_along_axis(state.seq_BS, state.cache.lengths[:, None], axis=1)[:, 0]


def prefill(config, params, prompt_BT, prompt_len_B, key, s: Settings, K: int,
            drafter=None, draft_params=None, policy=None, policy_state=None) -> LoopState:
    """Runs the ragged, right-padded prompts through the target (and the drafter) and
    emits each row's first token, which belongs to no round."""
    B, T = prompt_BT.shape
    cache = _shard(s, "cache", llama.init_cache(config, B, s.max_len, s.dtype))
    logits_B1V, cache = llama.forward_cached(config, params, prompt_BT, cache, dtype=s.dtype,
                                             select_BJ=(prompt_len_B - 1)[:, None])
    logits_B1V = _shard(s, "logits", logits_B1V)
    key, sub = jax.random.split(key)
    first_B = sampling.sample(sub, logits_B1V[:, 0], s.temperature, s.top_p)
    seq_BS = _shard(s, "rows", jnp.zeros((B, s.max_len), jnp.int32).at[:, :T].set(prompt_BT))
    draft_state = () if drafter is None else drafter.init(draft_params, prompt_BT, prompt_len_B, s.max_len)
    draft_state = _shard(s, "draft_cache", draft_state)
    if policy_state is None:
        policy_state = () if policy is None else policy.init_state(B)
    state = LoopState(cache._replace(lengths=prompt_len_B), seq_BS, prompt_len_B, jnp.zeros((B,), jnp.int32),
                      jnp.zeros((B,), bool), key, draft_state, policy_state, init_stats(B, K))
    zeros = jnp.zeros((B,), jnp.int32)
    state = commit(state, first_B[:, None], jnp.ones((B,), jnp.int32), zeros, s)
    return state._replace(stats=init_stats(B, K))


def target_only_round(config, params, state: LoopState, s: Settings) -> LoopState:
    """Autoregressive baseline: score the pending token, emit the next one."""
    logits_B1V, cache = llama.forward_cached(config, params, pending(state)[:, None], state.cache, dtype=s.dtype)
    logits_B1V, cache = _shard(s, "logits", logits_B1V), _shard(s, "cache", cache)
    key, sub = jax.random.split(state.key)
    next_B = sampling.sample(sub, logits_B1V[:, 0], s.temperature, s.top_p)
    ones = jnp.ones_like(next_B)
    return commit(state._replace(cache=cache, key=key), next_B[:, None], ones, ones, s)


def speculative_round(config, params, drafter, draft_params, policy, state: LoopState, s: Settings) -> LoopState:
    K = drafter.k
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    live_B = ~state.done_B
    L_B = state.cache.lengths
    pending_B = pending(state)
    # draft
    drafts_BK, num_draft_B, probs_BKV, draft_state = drafter.propose(
        draft_params, state.draft_state, state.seq_BS, L_B, k_draft, s.temperature)
    # score: only as many positions as the live rows' longest proposal needs
    fed_BR = jnp.concatenate([pending_B[:, None], drafts_BK], axis=1)
    width = jnp.max(jnp.where(live_B, num_draft_B, 0)) + 1
    logits_BRV, cache = score(config, params, fed_BR, state.cache, width, s)
    # verify
    verdict, policy_state, info = policy.verify(state.policy_state, drafts_BK, logits_BRV, num_draft_B, k_verify,
                                                live_B, probs_BKV)
    n_B = verdict.num_accepted
    # commit d[:n] + [next]
    j_R = jnp.arange(K + 1)
    drafts_BR = jnp.concatenate([drafts_BK, jnp.zeros_like(drafts_BK[:, :1])], axis=1)
    block_BR = jnp.where(j_R[None] < n_B[:, None], drafts_BR, verdict.next_token[:, None])
    stats = dict(state.stats)
    i_K = jnp.arange(K)
    stats["accepted_K"] += jnp.sum(live_B[:, None] & (i_K[None] < n_B[:, None]), axis=0)
    stats["offered_K"] += jnp.sum(live_B[:, None] & (i_K[None] < num_draft_B[:, None]), axis=0)
    stats["num_loose_B"] += info["num_loose"]
    stats["examined_B"] += info["examined"]
    stats["spent_B"] += info["spent"]
    draft_state = _shard(s, "draft_cache", draft_state)
    state = state._replace(cache=cache, key=key, draft_state=draft_state, policy_state=policy_state, stats=stats)
    return commit(state, block_BR, n_B + 1, n_B + 1, s)


def verify_widths(K: int) -> tuple[int, ...]:
    """Compiled widths of the target's verify forward: 1, about half, and K + 1.

    Each width is one more copy of the target forward in the program (compile time);
    1 covers rounds with nothing proposed, the middle one short proposals.
    """
    return tuple(sorted({1, K // 2 + 1, K + 1}))


def score(config, params, fed_BR, cache, width, s: Settings):
    """The target's logits on the first `width` fed positions, padded to K + 1 rows.

    A drafter may propose fewer than K tokens (prompt lookup, often none at all):
    on a CPU a 9-position forward costs about twice a 1-position one, so the
    forward runs at the smallest compiled width that covers every live row.
    Padding rows lie past each row's num_draft, where no rule reads.
    """
    B, R = fed_BR.shape
    widths = verify_widths(R - 1)

    def at(w):
        def run(fed_BR, cache):
            logits_BWV, cache = llama.forward_cached(config, params, fed_BR[:, :w], cache, dtype=s.dtype)
            return _shard(s, "logits", jnp.pad(logits_BWV, ((0, 0), (0, R - w), (0, 0)))), _shard(s, "cache", cache)
        return run

    if len(widths) == 1:
        logits_BRV, cache = at(R)(fed_BR, cache)
    else:
        branch = jnp.searchsorted(jnp.asarray(widths), width)
        logits_BRV, cache = jax.lax.switch(branch, [at(w) for w in widths], fed_BR, cache)
    return _shard(s, "logits", logits_BRV), _shard(s, "cache", cache)


def generate_program(config, s: Settings, drafter, policy, params, draft_params,
                     prompt_BT, prompt_len_B, seed, policy_state=None):
    """The whole generation as one traceable function (prefill + one while_loop).

    policy_state: the rule's starting state (None: `policy.init_state(B)`); it is
    returned at the end, so a CSD memory can carry on into the next call."""
    key = jax.random.PRNGKey(seed)
    K = 1 if drafter is None else drafter.k
    state = prefill(config, params, prompt_BT, prompt_len_B, key, s, K, drafter, draft_params, policy,
                    policy_state)
    if drafter is None:
        body = lambda st: target_only_round(config, params, st, s)  # noqa: E731
    else:
        body = lambda st: speculative_round(config, params, drafter, draft_params, policy, st, s)  # noqa: E731
    state = jax.lax.while_loop(lambda st: ~jnp.all(st.done_B), body, state)
    return state.seq_BS, state.num_out_B, state.stats, state.policy_state
