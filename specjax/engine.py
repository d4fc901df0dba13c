"""The generation engine: prefill, then one `jax.lax.while_loop` over rounds.

    prompt -> prefill (first token) -> while any row is live: round -> tokens, stats

A round scores each row's pending token (the last emitted one, not yet in the
target's cache) and commits the token that follows it. Committing is written
for blocks of `n + 1` tokens per row at per-row offsets (`commit`), the shape
that speculative rounds produce; target-only decoding is the case n = 0 and
is the baseline every speedup is measured against. The whole generation is
one compiled program: no host round trip per token or per round.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.models import llama
from specjax.models.llama import KVCache
from specjax.models.model import Model

METHODS = ("greedy", "exact")
_PROMPT_BUCKET = 16  # prompt lengths are padded to a multiple of this to limit recompiles
_CACHE_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class Settings:
    """Static, hashable generation settings (a jit static argument)."""

    max_new_tokens: int
    max_len: int
    temperature: float
    top_p: float
    eos_ids: tuple[int, ...]
    dtype: Any = jnp.float32


class LoopState(NamedTuple):
    """Everything the while_loop carries (one named pytree)."""

    cache: KVCache  # target cache; lengths[b] = tokens of row b already in it
    pending_B: jax.Array  # int32[B]: last emitted token, not yet in the cache
    out_BN: jax.Array  # int32[B, N]: emitted tokens (N = max_new_tokens)
    num_out_B: jax.Array  # int32[B]
    done_B: jax.Array  # bool[B]
    key: jax.Array
    rounds_B: jax.Array  # int32[B]: verification forwards in which the row was live
    round_tokens_B: jax.Array  # int32[B]: tokens emitted by rounds (the prefill token excluded)


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # per prompt: the new tokens only, up to and including EOS
    stats: dict[str, Any]


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
    room_B = s.max_new_tokens - state.num_out_B
    count_B = jnp.minimum(count_B, room_B)
    if s.eos_ids:
        is_eos_BJ = jnp.isin(block_BJ, jnp.asarray(s.eos_ids, jnp.int32)) & (j_J[None] < count_B[:, None])
        first_eos_B = jnp.where(is_eos_BJ.any(-1), jnp.argmax(is_eos_BJ, axis=-1), J)
        hit_eos_B = first_eos_B < count_B
        count_B = jnp.minimum(count_B, first_eos_B + 1)
    else:
        hit_eos_B = jnp.zeros((B,), bool)
    count_B = jnp.where(live_B, count_B, 0)
    write_BJ = jnp.where(j_J[None] < count_B[:, None], state.num_out_B[:, None] + j_J[None], s.max_new_tokens)
    out_BN = state.out_BN.at[jnp.arange(B)[:, None], write_BJ].set(block_BJ, mode="drop")
    num_out_B = state.num_out_B + count_B
    last_B = jnp.take_along_axis(block_BJ, jnp.maximum(count_B - 1, 0)[:, None], axis=1)[:, 0]
    return state._replace(
        cache=state.cache._replace(lengths=state.cache.lengths + jnp.where(live_B, advance_B, 0)),
        pending_B=jnp.where(live_B, last_B, state.pending_B),
        out_BN=out_BN,
        num_out_B=num_out_B,
        done_B=state.done_B | (live_B & (hit_eos_B | (num_out_B >= s.max_new_tokens))),
        rounds_B=state.rounds_B + live_B,
        round_tokens_B=state.round_tokens_B + count_B,
    )


def prefill(config, params, prompt_BT, prompt_len_B, key, s: Settings) -> LoopState:
    """Runs the ragged, right-padded prompts through the target and emits each row's first token."""
    B, T = prompt_BT.shape
    cache = llama.init_cache(config, B, s.max_len, s.dtype)
    last_B1 = (prompt_len_B - 1)[:, None]
    logits_B1V, cache = llama.forward_cached(config, params, prompt_BT, cache, dtype=s.dtype, select_BJ=last_B1)
    key, sub = jax.random.split(key)
    first_B = sampling.sample(sub, logits_B1V[:, 0], s.temperature, s.top_p)
    zeros = jnp.zeros((B,), jnp.int32)
    state = LoopState(cache._replace(lengths=prompt_len_B), first_B, jnp.zeros((B, s.max_new_tokens), jnp.int32),
                      zeros, jnp.zeros((B,), bool), key, zeros, zeros)
    # The prefill token is emitted like a round's but is not a round's: undo the round counters.
    state = commit(state, first_B[:, None], jnp.ones((B,), jnp.int32), zeros, s)
    return state._replace(rounds_B=zeros, round_tokens_B=zeros)


def target_only_round(config, params, state: LoopState, s: Settings) -> LoopState:
    """Autoregressive baseline: score the pending token, emit the next one."""
    logits_B1V, cache = llama.forward_cached(config, params, state.pending_B[:, None], state.cache, dtype=s.dtype)
    key, sub = jax.random.split(state.key)
    next_B = sampling.sample(sub, logits_B1V[:, 0], s.temperature, s.top_p)
    state = state._replace(cache=cache, key=key)
    ones = jnp.ones_like(next_B)
    return commit(state, next_B[:, None], ones, ones, s)


def generate_program(config, s: Settings, params, prompt_BT, prompt_len_B, key):
    """The whole generation as one traceable function (prefill + one while_loop)."""
    state = prefill(config, params, prompt_BT, prompt_len_B, key, s)
    state = jax.lax.while_loop(lambda st: ~jnp.all(st.done_B),
                               lambda st: target_only_round(config, params, st, s), state)
    return state.out_BN, state.num_out_B, state.rounds_B, state.round_tokens_B


class Engine:
    """Compiles and runs generation for a target model (see DESIGN.md's public API).

    Beyond DESIGN.md's arguments: `eos_ids` overrides the tokens that end a row
    (default: the model's EOS; `()` generates exactly max_new_tokens, as benchmarks do).
    """

    def __init__(self, target: Model, draft=None, method: str = "greedy", k: int = 8,
                 max_new_tokens: int = 128, max_len: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, mesh=None, eos_ids: Sequence[int] | None = None,
                 **rule_options):
        if not isinstance(target, Model):
            raise TypeError(f"target must be a specjax.models.Model, got {type(target).__name__}")
        if draft is not None:
            raise NotImplementedError("speculative drafts are not implemented yet: use draft=None")
        if mesh is not None:
            raise NotImplementedError("mesh= is not implemented yet: run on one device (mesh=None)")
        if rule_options:
            raise TypeError(f"unknown option(s) for method {method!r}: {', '.join(sorted(rule_options))}")
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r} (supported: {', '.join(METHODS)})")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if max_len is not None and max_len <= 1:
            raise ValueError(f"max_len must be > 1, got {max_len}")
        self.target, self.draft, self.method, self.k = target, draft, method, int(k)
        self.max_new_tokens, self.max_len = int(max_new_tokens), max_len
        self.temperature, self.top_p, self.seed, self.mesh = float(temperature), float(top_p), seed, mesh
        # eos_ids: tokens that end a row (None: the model's EOS; () : never stop early, for benchmarks)
        self.eos_ids = tuple(int(e) for e in (target.eos_token_ids if eos_ids is None else eos_ids))
        self._program = jax.jit(generate_program, static_argnums=(0, 1))

    # -- inputs --------------------------------------------------------------
    def _prepare(self, prompts: Sequence[Sequence[int]]):
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        V = self.target.config.vocab_size
        lengths = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)) or len(p) == 0:
                raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.60}")
            arr = np.asarray(p)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompt {i} must be a flat list of integer token ids")
            if arr.min() < 0 or arr.max() >= V:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {V})")
            lengths.append(len(arr))
        longest = max(lengths)
        needed = longest + self.max_new_tokens + self.k + 1  # room for a final K+1-token round
        if self.max_len is None:
            max_len = -(-needed // _CACHE_BUCKET) * _CACHE_BUCKET
        else:
            max_len = self.max_len
            if needed > max_len:
                raise ValueError(
                    f"request does not fit the cache: longest prompt {longest} + max_new_tokens "
                    f"{self.max_new_tokens} + k {self.k} + 1 = {needed} > max_len {max_len}")
        T = min(-(-longest // _PROMPT_BUCKET) * _PROMPT_BUCKET, max_len)
        prompt_BT = np.zeros((len(prompts), T), np.int32)
        for i, p in enumerate(prompts):
            prompt_BT[i, : lengths[i]] = p
        s = Settings(self.max_new_tokens, max_len, self.temperature, self.top_p,
                     self.eos_ids, self.target.dtype)
        args = (self.target.params, jnp.asarray(prompt_BT), jnp.asarray(lengths, jnp.int32),
                jax.random.PRNGKey(self.seed))
        return s, args

    # -- public --------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]]) -> GenerateOutput:
        s, args = self._prepare(prompts)
        out_BN, num_out_B, rounds_B, round_tokens_B = jax.device_get(
            self._program(self.target.config, s, *args))
        tokens = [out_BN[b, : num_out_B[b]].tolist() for b in range(out_BN.shape[0])]
        return GenerateOutput(tokens, _stats(rounds_B, round_tokens_B))

    def lower(self, prompts: Sequence[Sequence[int]]) -> jax.stages.Lowered:
        s, args = self._prepare(prompts)
        return self._program.lower(self.target.config, s, *args)


def _stats(rounds_B, round_tokens_B) -> dict[str, Any]:
    # tau per request = tokens emitted by rounds / rounds (SPEC.md, Metrics); a request
    # finished by its prefill token has no round and a tau of 0 by this definition.
    tau_B = np.where(rounds_B > 0, round_tokens_B / np.maximum(rounds_B, 1), 0.0)
    return {
        "tau": float(tau_B.mean()),
        "tau_per_request": tau_B.tolist(),
        "rounds": int(rounds_B.max()),
        "rounds_per_request": rounds_B.tolist(),
        "round_tokens_per_request": round_tokens_B.tolist(),
    }
