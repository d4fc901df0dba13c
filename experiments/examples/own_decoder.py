r"""A speculative decoder of its own, in plain JAX, that borrows only specjax's rules.

    python experiments/examples/own_decoder.py                        # greedy (exact) verification
    python experiments/examples/own_decoder.py --method fly --theta 0.3 --window 2
    python experiments/examples/own_decoder.py --method asd --budget 8 --gate 0.5

Nothing here goes through `specjax.Engine`, its loop or its drafters. The target is a
tiny random Llama-style model run with `specjax.models.llama`'s forward functions; the
drafter (a second model, here the target with noisy weights, decoding greedily on its
own KV cache), the round (draft, score, verify, commit), the caches' bookkeeping and the
statistics are this file's. From specjax it takes the per-sequence rules --
`verify.greedy`, `verify.fly`, `verify.asd` -- and maps them over the batch with
`jax.vmap` inside its own `jax.jit` and `jax.lax.while_loop`; ASD's ledger (one float32
per request) is carried by the loop from round to round. The rules' contract is
docs/rules.md.

Shapes (docs/rules.md, shape legend): B rows, T prompt width, S sequence and cache
length, K draft tokens, R = K + 1 scored positions, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from specjax import verify
from specjax.models import llama
from specjax.models.config import Config

METHODS = ("greedy", "fly", "asd")

# A tiny Llama-style target: grouped-query attention (4 query heads, 2 kv heads), RoPE, SwiGLU.
CONFIG = Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8)


def make_target(seed: int = 0):
    """Random parameters, scaled up so that the model is confident on some rows and
    uncertain on others (the loose rules treat the two differently)."""
    return jax.jit(lambda p: jax.tree.map(lambda w: w * 4.0, p))(llama.init_params(CONFIG, seed))


def make_prompts(batch: int, width: int, seed: int = 0) -> np.ndarray:
    """int32[B, T]: random tokens."""
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, width)).astype(np.int32)


def make_draft(params, noise: float = 0.1, seed: int = 1):
    """A draft model: the target with every weight perturbed by `noise` times its own scale.

    It agrees with the target on most tokens and not on all, which is what a drafter is.
    (Host NumPy: a handful of small arrays, no compilation.)"""
    rng = np.random.default_rng(seed)

    def perturb(w):
        w = np.asarray(w)
        return jnp.asarray(w + noise * w.std() * rng.standard_normal(w.shape).astype(w.dtype))

    return jax.tree.map(perturb, params)


# --- the drafter: K greedy steps of the draft model on its own KV cache --------------------


def draft_tokens(draft_params, draft_cache: llama.KVCache, last_B, *, k: int):
    """K greedy draft tokens per row, continuing from `last_B` (the last emitted token).

    The draft feeds last, d[0], ..., d[K-1] (K + 1 one-token forwards): the last step only
    writes d[K-1]'s keys and values, which the cache needs when all K drafts are accepted.
    The cache's lengths are left as they were; the caller commits them after verification.
    Returns drafts int32[B, K] and the cache with positions lengths .. lengths + K written.
    """
    lengths_B = draft_cache.lengths

    def step(carry, _):
        tok_B, cache = carry
        logits_B1V, cache = llama.forward_cached(CONFIG, draft_params, tok_B[:, None], cache)
        nxt_B = jnp.argmax(logits_B1V[:, 0], axis=-1).astype(jnp.int32)
        return (nxt_B, cache._replace(lengths=cache.lengths + 1)), nxt_B

    (_, draft_cache), drafts_RB = jax.lax.scan(step, (last_B, draft_cache), length=k + 1)
    return drafts_RB[:k].T, draft_cache._replace(lengths=lengths_B)


# --- the decoder -------------------------------------------------------------------------


class State(NamedTuple):
    """What the while_loop carries."""

    cache: llama.KVCache  # lengths[b] = position of row b's last emitted token (not yet in the cache)
    draft_cache: llama.KVCache  # the draft model's, with the same lengths
    seq_BS: jax.Array  # int32[B, S]: prompt, then emitted tokens
    num_out_B: jax.Array  # int32[B]: tokens emitted so far (the prefill's one included)
    ledger_B: jax.Array  # float32[B]: ASD's budget left per request (unused by the other rules)
    rounds_B: jax.Array  # int32[B]: verification forwards in which the row was still generating
    round_tokens_B: jax.Array  # int32[B]: tokens those rounds emitted
    loose_B: jax.Array  # int32[B]: mismatches a loose rule accepted


def verify_batch(method: str, drafts_BK, logits_BRV, num_draft_B, ledger_B, options):
    """One verify call for the batch: specjax's per-sequence rule under jax.vmap.

    options: a dict of float32 / int32 scalars (traced, so one compile serves every setting).
    Returns (n_B, next_B, num_loose_B, ledger_B).
    """
    if method == "greedy":
        v = jax.vmap(lambda d, L, k: verify.greedy(d, L, num_draft=k))(drafts_BK, logits_BRV, num_draft_B)
        return v.num_accepted, v.next_token, v.num_loose, ledger_B
    if method == "fly":
        def row(d, L, k):
            return verify.fly(d, L, theta=options["theta"], window=options["window"], num_draft=k)

        v = jax.vmap(row)(drafts_BK, logits_BRV, num_draft_B)
        return v.num_accepted, v.next_token, v.num_loose, ledger_B
    if method == "asd":
        def row(d, L, k, budget_left):
            return verify.asd(d, L, budget_left, gate=options["gate"], block_cap=options["block_cap"], num_draft=k)

        v, left_B = jax.vmap(row)(drafts_BK, logits_BRV, num_draft_B, ledger_B)
        return v.num_accepted, v.next_token, v.num_loose, left_B
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


@functools.partial(jax.jit, static_argnames=("method", "k", "max_new_tokens"))
def speculative_decode(params, draft_params, prompt_BT, options, *, method: str, k: int, max_new_tokens: int):
    """Greedy-target speculative decoding of equal-length prompts; returns the final State.

    Row b's new tokens are seq_BS[b, T : T + max_new_tokens].
    """
    B, T = prompt_BT.shape
    S = T + max_new_tokens + k + 1  # room for the last round's K + 1 scored positions
    cache = llama.init_cache(CONFIG, B, S)
    # Prefill: the prompt fills the cache; its last logits give the first token (no round's).
    logits_BTV, cache = llama.forward_cached(CONFIG, params, prompt_BT, cache)
    _, draft_cache = llama.forward_cached(CONFIG, draft_params, prompt_BT, llama.init_cache(CONFIG, B, S))
    first_B = jnp.argmax(logits_BTV[:, -1], axis=-1).astype(jnp.int32)
    seq_BS = jnp.zeros((B, S), jnp.int32).at[:, :T].set(prompt_BT).at[:, T].set(first_B)
    zeros_B = jnp.zeros((B,), jnp.int32)
    lengths_B = jnp.full((B,), T, jnp.int32)
    state = State(cache._replace(lengths=lengths_B), draft_cache._replace(lengths=lengths_B), seq_BS, zeros_B + 1,
                  jnp.full((B,), options["budget"], jnp.float32), zeros_B, zeros_B, zeros_B)

    def live(state):
        return state.num_out_B < max_new_tokens

    def round_(state: State) -> State:
        pos_B = state.cache.lengths  # the last emitted token, fed first
        live_B = live(state)
        last_B = jnp.take_along_axis(state.seq_BS, pos_B[:, None], axis=1)[:, 0]
        drafts_BK, draft_cache = draft_tokens(draft_params, state.draft_cache, last_B, k=k)
        # Every row proposes K tokens here; a drafter that proposes fewer passes its count and
        # pads the rest (the rules never accept padding).
        num_draft_B = jnp.full((B,), k, jnp.int32)
        fed_BR = jnp.concatenate([last_B[:, None], drafts_BK], axis=1)
        # Score: logits_BRV[b, i] is the target's next-token logits after seq[:pos] + drafts[:i].
        logits_BRV, cache = llama.forward_cached(CONFIG, params, fed_BR, state.cache)
        n_B, next_B, loose_B, ledger_B = verify_batch(method, drafts_BK, logits_BRV, num_draft_B,
                                                      state.ledger_B, options)
        # Commit drafts[:n] + [next], cut at the token budget; finished rows keep everything.
        j_R = jnp.arange(k + 1)
        drafts_BR = jnp.concatenate([drafts_BK, jnp.zeros_like(drafts_BK[:, :1])], axis=1)
        block_BR = jnp.where(j_R[None] < n_B[:, None], drafts_BR, next_B[:, None])
        count_B = jnp.where(live_B, jnp.minimum(n_B + 1, max_new_tokens - state.num_out_B), 0)
        write_BR = jnp.where(j_R[None] < count_B[:, None], pos_B[:, None] + 1 + j_R[None], S)  # S: dropped
        seq_BS = state.seq_BS.at[jnp.arange(B)[:, None], write_BR].set(block_BR, mode="drop")
        # The cache keeps the fed token and the accepted drafts; `next` is fed next round.
        lengths_B = pos_B + jnp.where(live_B, n_B + 1, 0)
        return State(cache=cache._replace(lengths=lengths_B), draft_cache=draft_cache._replace(lengths=lengths_B),
                     seq_BS=seq_BS, num_out_B=state.num_out_B + count_B,
                     ledger_B=jnp.where(live_B, ledger_B, state.ledger_B),  # finished rows are not charged
                     rounds_B=state.rounds_B + live_B, round_tokens_B=state.round_tokens_B + count_B,
                     loose_B=state.loose_B + jnp.where(live_B, loose_B, 0))

    return jax.lax.while_loop(lambda s: jnp.any(live(s)), round_, state)


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def greedy_decode(params, prompt_BT, *, max_new_tokens: int):
    """Target-only greedy decoding, one token per forward: int32[B, M], M = max_new_tokens."""
    B, T = prompt_BT.shape
    cache = llama.init_cache(CONFIG, B, T + max_new_tokens)
    logits_BTV, cache = llama.forward_cached(CONFIG, params, prompt_BT, cache)
    out_BM = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(jnp.argmax(logits_BTV[:, -1], -1))
    cache = cache._replace(lengths=jnp.full((B,), T, jnp.int32))

    def step(i, carry):
        out_BM, cache = carry
        last_B1 = jax.lax.dynamic_slice_in_dim(out_BM, i - 1, 1, axis=1)
        logits_B1V, cache = llama.forward_cached(CONFIG, params, last_B1, cache)
        out_BM = out_BM.at[:, i].set(jnp.argmax(logits_B1V[:, 0], -1).astype(jnp.int32))
        return out_BM, cache._replace(lengths=cache.lengths + 1)

    return jax.lax.fori_loop(1, max_new_tokens, step, (out_BM, cache))[0]


def options_of(theta=0.3, window=6, budget=8.0, gate=0.25, block_cap=2) -> dict:
    """Rule settings as traced scalars (changing them does not recompile)."""
    return {"theta": jnp.float32(theta), "window": jnp.int32(window), "budget": jnp.float32(budget),
            "gate": jnp.float32(gate), "block_cap": jnp.int32(block_cap)}


def run(params, draft_params, prompt_BT, *, method="greedy", k=4, max_new_tokens=32, **options) -> dict:
    """Decodes and returns host results: tokens [B, max_new_tokens], tau, rounds, loose, ledger."""
    state = jax.device_get(speculative_decode(params, draft_params, jnp.asarray(prompt_BT), options_of(**options),
                                              method=method, k=k, max_new_tokens=max_new_tokens))
    T = prompt_BT.shape[1]
    tau_B = state.round_tokens_B / np.maximum(state.rounds_B, 1)
    return {"tokens": state.seq_BS[:, T:T + max_new_tokens], "tau": float(tau_B.mean()),
            "rounds_B": state.rounds_B, "round_tokens_B": state.round_tokens_B,
            "loose_B": state.loose_B, "ledger_B": state.ledger_B, "num_out_B": state.num_out_B}


def define_flags():
    """The binary's flags (defined only when run as a script, so that importing the module
    for its functions adds nothing to absl's global FLAGS)."""
    flags.DEFINE_enum("method", "greedy", list(METHODS), "Verification rule from specjax.verify.")
    flags.DEFINE_integer("k", 4, "Draft tokens per round.")
    flags.DEFINE_integer("max_new_tokens", 32, "New tokens per prompt.")
    flags.DEFINE_integer("batch", 3, "Prompts (rows).")
    flags.DEFINE_integer("seed", 0, "Seed of the random target, its draft and the prompts.")
    flags.DEFINE_float("noise", 0.1, "The draft model's weight noise, relative to each weight's scale.")
    flags.DEFINE_float("theta", 0.3, "fly: entropy gate (normalized entropy).")
    flags.DEFINE_integer("window", 6, "fly: deferred window (paper rule).")
    flags.DEFINE_float("budget", 8.0, "asd: regret budget per request.")
    flags.DEFINE_float("gate", 0.25, "asd: per-token regret gate.")
    flags.DEFINE_integer("block_cap", 2, "asd: loose acceptances per round.")


def report(params, draft_params, prompt_BT, *, method="greedy", k=4, max_new_tokens=32, **options) -> list[str]:
    """Decodes, compares each row with target-only greedy decoding, and returns the lines to print."""
    out = run(params, draft_params, prompt_BT, method=method, k=k, max_new_tokens=max_new_tokens, **options)
    reference = np.asarray(greedy_decode(params, jnp.asarray(prompt_BT), max_new_tokens=max_new_tokens))
    lines = []
    for b in range(len(prompt_BT)):
        same = "same as" if np.array_equal(out["tokens"][b], reference[b]) else "differs from"
        ledger = f", ledger left {out['ledger_B'][b]:.3f}" if method == "asd" else ""
        lines.append(f"row {b}: {out['tokens'][b].tolist()}")
        tau = out["round_tokens_B"][b] / max(out["rounds_B"][b], 1)
        lines.append(f"       {out['rounds_B'][b]} rounds, tau {tau:.2f}, {out['loose_B'][b]} loose, "
                     f"{same} target-only greedy{ledger}")
    lines.append(f"method {method}, K = {k}: tau {out['tau']:.2f}")
    return lines


def main(argv):
    del argv
    f = flags.FLAGS
    params = make_target(f.seed)
    lines = report(params, make_draft(params, f.noise, f.seed + 1), make_prompts(f.batch, 16, f.seed),
                   method=f.method, k=f.k, max_new_tokens=f.max_new_tokens, theta=f.theta, window=f.window,
                   budget=f.budget, gate=f.gate, block_cap=f.block_cap)
    print("\n".join(lines))


if __name__ == "__main__":
    define_flags()
    app.run(main)
