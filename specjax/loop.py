"""The compiled generation: prefill, then one `jax.lax.while_loop` over rounds.

    prompt -> prefill (first token) -> while any row is live: round -> tokens, counters

A speculative round reads top to bottom as the algorithm does:

    draft    K tokens per row (a draft model's scan, prompt lookup, ...)
    score    the target runs once on [pending, d_0 .. d_{K-1}] at each row's offset
    verify   the rule gives n (accepted drafts) and the next token per row
    commit   each row emits d[:n] + [next] and moves its length pointer by n + 1

Target-only decoding is the same loop without a drafter: score the pending
token, emit the next one. Rejected positions are never erased: the length
pointers move, and attention masks by position.

`Program` holds only static, hashable settings and is jitted with
`static_argnames=("self",)`; everything that varies between calls (parameters,
prompts, the seed, the rule's starting state) is a keyword argument. How the
program computes (matmul path, head chunking, attention and Pallas kernels, the
mesh, vocabulary sharding) is its `backend` (`specjax.backend.Backend`), handed as
an argument to the model's forward, the drafter and the rule: no context decides it.
Shapes: docs/rules.md, shape legend.

Adaptive width (`Program.adaptive`, docs/adaptive.md): each round verifies only the draft
prefix whose expected tokens pay for its width, from running acceptance counts per draft
position (and per drafter level) against a cost table (seconds per verify width and per draft
step, a runtime input); width 1 is a plain decode step that skips the rule.

Why one file of about 500 lines: the compiled program is read here in one place, its state,
the round, the adaptive policy's small functions and the counters it reports; split, each
prompt's trace would cross more files (tests/test_layering.py keeps that path to 8).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.backend import PLAIN, Backend
from specjax.drafters import Drafter
from specjax.models import llama
from specjax.models.config import Config
from specjax.models.llama import KVCache
from specjax.verify import CSDMemory, RoundCounts
from specjax.verify._common import sample


@struct.dataclass(kw_only=True)
class Params:
    """The parameters a program reads: the target's, and the draft model's (or () without one)."""

    target: Any
    draft: Any = ()


@struct.dataclass(kw_only=True)
class LoopState:
    """Everything the while_loop carries."""

    cache: KVCache  # target cache; cache.lengths[b] = L: row b's pending token sits at seq_BS[b, L]
    seq_BS: jax.Array  # int32[B, S]: prompt, then emitted tokens
    prompt_len_B: jax.Array  # int32[B]
    num_out_B: jax.Array  # int32[B]: emitted tokens; L = prompt_len + num_out - 1
    done_B: jax.Array  # bool[B]
    key: jax.Array  # PRNG key, split once per round
    draft_state: Any  # the drafter's own state (a draft KV cache, or ())
    rule_state: Any  # the rule's state (ASD ledgers, CSD memory, or ())
    counters: Counters  # what the statistics are made of (`statistics`, below)
    adapt: Any = ()  # Adapt (acceptance counts, widths chosen) when the program is adaptive, else ()


# The adaptive policy's constants. A level's counts decay by DECAY in each round in which it
# proposed something (verified or not; a round with nothing proposed tells nothing and ages
# nothing), so an estimate rests on about the last 1 / (1 - DECAY) = 20 such rounds, and a
# position that is no longer verified drifts back to its prior (weight PRIOR_WEIGHT rounds): for
# position 0 the levels' pooled estimate (PRIOR_ACCEPT, even odds, before any evidence), for a
# later one the estimate of the position before it (`acceptance`). That is the exploration: a
# narrow policy widens again after some rounds and relearns (no separate probe rounds). The counts
# can start from an earlier call's (`Program.run`'s adaptation), so a stream of requests does not
# relearn its draft from even odds each time.
DECAY = 0.95
PRIOR_ACCEPT = 0.5
PRIOR_WEIGHT = 2.0


@struct.dataclass(kw_only=True)
class Adapt:
    """What the adaptive policy carries: decayed acceptance counts per drafter level and draft
    position, and how many rounds verified each width."""

    hits_LK: jax.Array  # float32[levels, K]: rounds in which position j was accepted (decayed)
    trials_LK: jax.Array  # float32[levels, K]: rounds in which position j was verified and reached
    widths_W: jax.Array  # int32[K + 2]: rounds per verified width (index = width; 1 = plain step)

    @classmethod
    def zeros(cls, levels: int, K: int, xp=jnp) -> "Adapt":
        """xp=np builds host arrays (an input made without launching anything on the device)."""
        z = xp.zeros((levels, K), xp.float32)
        return cls(hits_LK=z, trials_LK=z, widths_W=xp.zeros((K + 2,), xp.int32))


def acceptance(adapt: Adapt) -> jax.Array:
    """Conditional acceptance p[l, j] = P(position j accepted | positions < j accepted): float32[L, K].

    Each position's counts are shrunk towards the estimate of the position before it (position 0
    towards the pooled position 0 of all levels, that towards PRIOR_ACCEPT): a position seldom
    reached inherits what the reached ones show, so a
    lookup whose first draft is kept one time in three does not look like a five-token run because
    its deeper positions were never verified."""
    hits_LK, trials_LK = adapt.hits_LK, adapt.trials_LK
    # position 0 of every level shrinks towards the levels' pooled estimate (itself shrunk towards
    # PRIOR_ACCEPT): a level that has not proposed yet starts from what the others showed
    pooled = (hits_LK[:, 0].sum() + PRIOR_WEIGHT * PRIOR_ACCEPT) / (trials_LK[:, 0].sum() + PRIOR_WEIGHT)
    prior_L = jnp.full(hits_LK.shape[:1], pooled, jnp.float32)
    columns = []
    for j in range(hits_LK.shape[1]):  # K is small and static: a chain of elementwise ops, fused
        prior_L = (hits_LK[:, j] + PRIOR_WEIGHT * prior_L) / (trials_LK[:, j] + PRIOR_WEIGHT)
        columns.append(prior_L)
    return jnp.stack(columns, axis=1)


def expected_tokens(p_BK, num_draft_B, widths) -> jax.Array:
    """E[tokens emitted] per row and compiled width: 1 + sum_{j < min(w - 1, num_draft)} prod_{i <= j} p_i.
    float32[B, W]."""
    K = p_BK.shape[1]
    reach_BK = jnp.cumprod(p_BK, axis=1)
    m_BW = jnp.minimum(jnp.asarray(widths, jnp.int32)[None] - 1, num_draft_B[:, None])
    upto_BWK = jnp.arange(K)[None, None] < m_BW[:, :, None]
    return 1.0 + jnp.sum(jnp.where(upto_BWK, reach_BK[:, None], 0.0), axis=-1)


def choose_width(expected_BW, live_B, cost_W, allowed_W) -> jax.Array:
    """Index of the compiled width with the most expected tokens per second over the live rows
    (the smallest on ties). int32[]."""
    rate_W = jnp.sum(jnp.where(live_B[:, None], expected_BW, 0.0), axis=0) / cost_W
    return jnp.argmax(jnp.where(allowed_W, rate_W, -jnp.inf)).astype(jnp.int32)


def learn(adapt: Adapt, level_B, num_draft_B, n_B, live_B, proposed_B=None) -> Adapt:
    """Adds this round's counts: per row, the verified positions (`num_draft_B`) up to the first
    rejection were tried, the accepted ones hit. A level's counts first decay if a live row of it
    proposed anything (`proposed_B`, before the width cut it; default `num_draft_B`)."""
    L, K = adapt.hits_LK.shape
    proposed_B = num_draft_B if proposed_B is None else proposed_B
    j_K = jnp.arange(K)
    verified_BK = live_B[:, None] & (j_K[None] < num_draft_B[:, None])
    reached_BK = (verified_BK & (j_K[None] <= n_B[:, None])).astype(jnp.float32)
    hit_BK = (verified_BK & (j_K[None] < n_B[:, None])).astype(jnp.float32)
    level_BL = (level_B[:, None] == jnp.arange(L)[None]).astype(jnp.float32)
    asked_L = (level_BL.T @ (live_B & (proposed_B > 0)).astype(jnp.float32)) > 0
    decay_L1 = jnp.where(asked_L, DECAY, 1.0)[:, None]
    return adapt.replace(hits_LK=decay_L1 * adapt.hits_LK + level_BL.T @ hit_BK,
                         trials_LK=decay_L1 * adapt.trials_LK + level_BL.T @ reached_BK)


@struct.dataclass(kw_only=True)
class Output:
    seq_BS: jax.Array  # int32[B, S]
    num_out_B: jax.Array  # int32[B]: new tokens of row b are seq_BS[b, prompt_len_B[b]:][:num_out_B[b]]
    counters: Counters
    rule_state: Any  # the rule's final state, to carry into the next call
    adapt: Any = ()  # the policy's final Adapt (adaptive programs), to start the next call from, else ()

    @property
    def widths_W(self) -> Any:
        """int32[K + 2]: rounds per verified width (adaptive programs), else ()."""
        return self.adapt.widths_W if isinstance(self.adapt, Adapt) else ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """One generation program: the static settings of prefill + the while_loop.

    drafter None with rule None is target-only decoding; otherwise both are set.
    adaptive: each round verifies the width its expected tokens pay for (`run`'s `costs`);
    False: every round verifies the whole proposal (the fixed-K loop).
    layout: a `sharding.Layout` on a mesh (None: one device, no constraints at all).
    backend: how the program computes (`specjax.backend.Backend`, built by the Engine).
    """

    config: Config
    max_new_tokens: int
    max_len: int  # S, the cache length
    temperature: float
    top_p: float
    eos_ids: tuple[int, ...]
    dtype: Any = jnp.float32
    drafter: Drafter | None = None
    rule: Any = None
    layout: Any = None
    backend: Backend = PLAIN
    adaptive: bool = False

    @property
    def k(self) -> int:
        return 0 if self.drafter is None else self.drafter.k

    @property
    def adapts(self) -> bool:
        return self.adaptive and self.drafter is not None

    @property
    def widths(self) -> tuple[int, ...]:
        """The compiled verify widths."""
        return adaptive_widths(self.k) if self.adaptive else verify_widths(self.k)

    def cost_input(self, table) -> dict:
        """`run`'s costs from a `specjax.costs.CostTable` (seconds at every width 1 .. K + 1): its
        figures at the compiled widths; None: flat figures, for a program only lowered (its shapes
        are all that matter then)."""
        if table is None:
            return {"verify_W": np.ones(len(self.widths), np.float32), "draft_step": np.float32(0.0)}
        return {"verify_W": np.asarray([table.verify_s[w - 1] for w in self.widths], np.float32),
                "draft_step": np.float32(table.draft_step_s)}

    @functools.partial(jax.jit, static_argnames=("self",))
    def run(self, *, params: Params, prompt_BT, prompt_len_B, seed, rule_state, costs=(), draft_prompt=(),
            adaptation=()) -> Output:
        """The whole generation: prefill, then rounds until every row is done.

        costs (adaptive programs): {"verify_W": float32[len(widths)] seconds of a verify forward at
        each compiled width, "draft_step": float32[] seconds of one draft step}; else ().
        draft_prompt: () or (ids_BTd, len_B), the draft's own prompt for a draft of another
        vocabulary (`cross_draft.CrossVocabDrafter.init`'s draft_prompt_BT, draft_prompt_len_B).
        adaptation (adaptive programs): () to start from no counts, or an `Adapt` of this drafter's
        levels and K, e.g. an earlier call's `Output.adapt`."""
        if self.adapts and not (isinstance(costs, dict) and set(costs) == {"verify_W", "draft_step"}):
            raise ValueError("an adaptive program needs costs={'verify_W': ..., 'draft_step': ...}")
        state = self.prefill(params, prompt_BT, prompt_len_B, jax.random.PRNGKey(seed), rule_state, draft_prompt,
                             adaptation)
        if self.drafter is None:
            body = functools.partial(self.target_only_round, params)
        elif self.adaptive:
            body = functools.partial(self.adaptive_round, params, costs)
        else:
            body = functools.partial(self.speculative_round, params)
        state = jax.lax.while_loop(lambda st: ~jnp.all(st.done_B), body, state)
        out = Output(seq_BS=state.seq_BS, num_out_B=state.num_out_B, counters=state.counters,
                     rule_state=state.rule_state, adapt=state.adapt)
        # replicated outputs: every process of a multi-process run reads them
        return out if self.layout is None else jax.lax.with_sharding_constraint(out, self.layout.replicated)

    @functools.partial(jax.jit, static_argnames=("self",))
    def start(self, *, params: Params, prompt_BT, prompt_len_B, seed, rule_state, costs=(), draft_prompt=(),
              adaptation=()) -> LoopState:
        """The loop state after prefill, as `run` starts its rounds from it (`run`'s arguments)."""
        del costs  # `run`'s arguments, as the Engine prepares them
        return self.prefill(params, prompt_BT, prompt_len_B, jax.random.PRNGKey(seed), rule_state, draft_prompt,
                            adaptation)

    @functools.partial(jax.jit, static_argnames=("self", "n"), donate_argnames=("state",))
    def rounds(self, params: Params, costs, state: LoopState, n: int) -> LoopState:
        """n adaptive rounds from `state`, as the while_loop runs them (the body in a loop, the cache
        updated in place): what `specjax.costs` times per width, forced through `costs`."""
        body = functools.partial(self.adaptive_round, params, costs)
        return jax.lax.fori_loop(0, n, lambda _, st: body(st), state)

    def forward(self, params, tokens_BT, cache, select_BJ=None, write=True):
        """The target on `tokens_BT` at each row's offset: (logits, its last layer's features where the
        drafter reads them (`Drafter.uses_features`) else None, the cache with their keys and values;
        write=False: those keys and values, a `llama.NewKV`, the cache only read)."""
        if self.drafter is not None and self.drafter.uses_features:
            return llama.forward_features(self.config, params.target, tokens_BT, cache, dtype=self.dtype,
                                          select_BJ=select_BJ, backend=self.backend, write=write)
        logits, kv = llama.forward_cached(self.config, params.target, tokens_BT, cache, dtype=self.dtype,
                                          select_BJ=select_BJ, backend=self.backend, write=write)
        return logits, None, kv

    # -- the pieces of the loop -------------------------------------------------

    def _shard(self, kind: str, x):
        """Pins `x` (an array, a KVCache, or a drafter state) to the layout's sharding of `kind`."""
        return x if self.layout is None else self.layout.constrain(kind, x)

    def prefill(self, params: Params, prompt_BT, prompt_len_B, key, rule_state, draft_prompt=(),
                adaptation=()) -> LoopState:
        """Runs the ragged, right-padded prompts through the target (and the drafter) and
        emits each row's first token, which belongs to no round."""
        B, T = prompt_BT.shape
        cache = self._shard("cache", llama.init_cache(self.config, B, self.max_len, self.dtype))
        logits_B1V, feats_BTD, cache = self.forward(params, prompt_BT, cache, select_BJ=(prompt_len_B - 1)[:, None])
        logits_B1V = self._shard("logits", logits_B1V)
        key, sub = jax.random.split(key)
        first_B = sample(sub, logits_B1V[:, 0], self.temperature, self.top_p)
        seq_BS = self._shard("rows", jnp.zeros((B, self.max_len), jnp.int32).at[:, :T].set(prompt_BT))
        own = {} if not draft_prompt else dict(zip(("draft_prompt_BT", "draft_prompt_len_B"), draft_prompt))
        draft_state = () if self.drafter is None else self.drafter.init(
            params.draft, prompt_BT, prompt_len_B, self.max_len, features_BTD=feats_BTD, backend=self.backend, **own)
        state = LoopState(cache=cache._replace(lengths=prompt_len_B), seq_BS=seq_BS, prompt_len_B=prompt_len_B,
                          num_out_B=jnp.zeros((B,), jnp.int32), done_B=jnp.zeros((B,), bool), key=key,
                          draft_state=self._shard("draft_cache", draft_state), rule_state=rule_state,
                          counters=Counters.zeros(B, self.k),
                          adapt=self.initial_adapt(adaptation) if self.adapts else ())
        state, _ = self.commit(state, first_B[:, None], jnp.ones((B,), jnp.int32), jnp.zeros((B,), jnp.int32))
        return state

    def initial_adapt(self, adaptation, xp=jnp) -> Adapt:
        """The policy's starting counts: none, or `adaptation`'s (`run`), checked against this program
        (xp=np: as host arrays, for the program's input)."""
        fresh = Adapt.zeros(self.drafter.levels, self.k, xp)
        if isinstance(adaptation, tuple) and not adaptation:
            return fresh
        shapes = {jnp.shape(adaptation.hits_LK), jnp.shape(adaptation.trials_LK)} if isinstance(
            adaptation, Adapt) else {type(adaptation).__name__}
        if shapes != {fresh.hits_LK.shape}:
            raise ValueError(f"adaptation must be an Adapt of {fresh.hits_LK.shape[0]} drafter levels x K = "
                             f"{self.k} positions (an earlier output's, of the same drafter and k), got "
                             f"{' and '.join(map(str, sorted(shapes, key=str)))}")
        # the counts carry on; the widths are counted per call
        return fresh.replace(hits_LK=xp.asarray(adaptation.hits_LK, xp.float32),
                             trials_LK=xp.asarray(adaptation.trials_LK, xp.float32))

    def target_only_round(self, params: Params, state: LoopState) -> LoopState:
        """Autoregressive baseline: score the pending token, emit the next one."""
        live_B = ~state.done_B
        logits_B1V, _, cache = self.forward(params, pending(state)[:, None], state.cache)
        logits_B1V, cache = self._shard("logits", logits_B1V), self._shard("cache", cache)
        key, sub = jax.random.split(state.key)
        next_B = sample(sub, logits_B1V[:, 0], self.temperature, self.top_p)
        ones_B = jnp.ones_like(next_B)
        state, emitted_B = self.commit(state.replace(cache=cache, key=key), next_B[:, None], ones_B, ones_B)
        return state.replace(counters=state.counters.update(live_B=live_B, emitted_B=emitted_B))

    def speculative_round(self, params: Params, state: LoopState) -> LoopState:
        """Draft, score the whole proposal (at the smallest compiled width covering it), verify, commit."""
        key, k_draft, k_verify = jax.random.split(state.key, 3)
        live_B = ~state.done_B
        # draft
        drafts_BK, num_draft_B, probs_BKV, draft_state = self.drafter.propose(
            params.draft, state.draft_state, state.seq_BS, state.cache.lengths, k_draft, self.temperature,
            backend=self.backend)
        # score: only as many positions as the live rows' longest proposal needs
        fed_BR = jnp.concatenate([pending(state)[:, None], drafts_BK], axis=1)
        width = jnp.max(jnp.where(live_B, num_draft_B, 0)) + 1
        logits_BRV, kv, feats_BRD = self.score(params, fed_BR, state.cache, width)
        cache = self._shard("cache", llama.write_kv(state.cache, kv, width))
        draft_state = self.drafter.observe(draft_state, feats_BRD, state.cache.lengths)  # what the target saw
        # verify (on a mesh, the backend's vocabulary sharding reduces the logits shard by shard), commit
        verdict, rule_state, counts = self.rule(
            state.rule_state, drafts_BK, logits_BRV, num_draft_B=num_draft_B, key=k_verify, active_B=live_B,
            draft_probs_BKV=probs_BKV, temperature=self.temperature, backend=self.backend)
        state = state.replace(cache=cache, key=key, draft_state=draft_state, rule_state=rule_state)
        return self._commit_round(state, live_B, drafts_BK, num_draft_B, verdict.num_accepted, verdict.next_token,
                                  counts)

    def adaptive_round(self, params: Params, costs, state: LoopState) -> LoopState:
        """A speculative round that verifies only what pays: choose, draft, choose again, then a
        plain step (width 1: no rule) or score + verify at the chosen width, commit, learn."""
        K, widths = self.k, self.widths
        w_W = jnp.asarray(widths, jnp.int32)
        key, k_draft, k_verify = jax.random.split(state.key, 3)
        live_B = ~state.done_B
        p_LK = acceptance(state.adapt)
        verify_W = costs["verify_W"]
        # draft: a drafter whose steps cost drafts only as many as the best width (by its
        # levels' best estimates, all K offered) verifies; a plain step still feeds its cache
        short = self.drafter.truncated
        if short is None:
            cap = jnp.int32(len(widths) - 1)
            drafts_BK, num_draft_B, probs_BKV, draft_state, level_B = _propose(
                self.drafter, params.draft, state, k_draft, self.temperature, self.backend)
        else:
            B = live_B.shape[0]
            full_B = jnp.full((B,), K, jnp.int32)
            best_BK = jnp.broadcast_to(p_LK.max(axis=0), (B, K))
            steps_W = jnp.maximum(w_W - 1, 1).astype(jnp.float32)
            cap = choose_width(expected_tokens(best_BK, full_B, widths), live_B,
                               verify_W + costs["draft_step"] * steps_W, jnp.ones(len(widths), bool))

            def draft_at(w):
                def run(draft_state):
                    d, nd, probs, draft_state, level = _propose(short(max(w - 1, 1)), params.draft, state.replace(
                        draft_state=draft_state), k_draft, self.temperature, self.backend)
                    pad = ((0, 0), (0, K - d.shape[1]))
                    probs = None if probs is None else jnp.pad(probs, pad + ((0, 0),))
                    return jnp.pad(d, pad), nd, probs, draft_state, level
                return run

            drafts_BK, num_draft_B, probs_BKV, draft_state, level_B = jax.lax.switch(
                cap, [draft_at(w) for w in widths], state.draft_state)
        # choose: the width with the most expected tokens per second of verification (the drafts are made)
        num_draft_B = jnp.where(live_B, num_draft_B, 0)
        expected_BW = expected_tokens(p_LK[level_B], num_draft_B, widths)
        choice = choose_width(expected_BW, live_B, verify_W, jnp.arange(len(widths)) <= cap)
        width = w_W[choice]
        proposed_B, num_draft_B = num_draft_B, jnp.minimum(num_draft_B, width - 1)
        fed_BR = jnp.concatenate([pending(state)[:, None], drafts_BK], axis=1)

        # XLA copies the cache into a branch that writes it unless that branch is the only writer:
        # the plain step writes in place (as target-only decoding does, no copy of the native
        # attention's layer either), a verify only reads the cache and returns the new keys and
        # values, written after the branches join (none after a plain step). Each verify width is
        # its own branch, forward and rule at that width: the rule's work on a narrow round is
        # that of a narrow round, not of K + 1 padded rows. The widths sit in a switch inside the
        # cond's second branch, which alone hands the cache back: one flat switch of all widths,
        # each handing it back, made XLA copy the cache every round (a plain round then cost
        # 1.19 target steps on SmolLM2 instead of 1.00).
        def plain(cache, rule_state):  # nothing verified: the target-only step, no rule
            logits_B1V, feats_B1D, cache = self.forward(params, fed_BR[:, :1], cache)
            logits_B1V = self._shard("logits", logits_B1V)
            next_B = sample(k_verify, logits_B1V[:, 0], self.temperature, self.top_p)
            zi = jnp.zeros_like(next_B)
            counts = RoundCounts(zi, zi, jnp.zeros(next_B.shape, jnp.float32))
            return zi, next_B, cache, _no_kv(cache, K + 1), rule_state, counts, _pad_positions(feats_B1D, K + 1)

        def verify_at(w):
            def run(cache, rule_state):
                logits_BWV, feats_BWD, kv = self.forward(params, fed_BR[:, :w], cache, write=False)
                probs = None if probs_BKV is None else probs_BKV[:, :w - 1]
                verdict, rule_state, counts = self.rule(
                    rule_state, drafts_BK[:, :w - 1], self._shard("logits", logits_BWV), num_draft_B=num_draft_B,
                    key=k_verify, active_B=live_B, draft_probs_BKV=probs, temperature=self.temperature,
                    backend=self.backend)
                return (verdict.num_accepted, verdict.next_token, _pad_positions(kv, K + 1), rule_state, counts,
                        _pad_positions(feats_BWD, K + 1))
            return run

        def speculate(cache, rule_state):  # the cache is only read here, and not handed back
            n_B, next_B, kv, rule_state, counts, feats_BRD = jax.lax.switch(
                choice - 1, [verify_at(w) for w in widths[1:]], cache, rule_state)
            return n_B, next_B, cache, kv, rule_state, counts, feats_BRD

        n_B, next_B, cache, kv, rule_state, counts, feats_BRD = jax.lax.cond(
            width == 1, plain, speculate, state.cache, state.rule_state)
        cache = self._shard("cache", llama.write_kv(cache, kv, jnp.where(width == 1, 0, width)))
        draft_state = self.drafter.observe(draft_state, feats_BRD, state.cache.lengths)
        adapt = learn(state.adapt, level_B, num_draft_B, n_B, live_B, proposed_B)
        adapt = adapt.replace(widths_W=adapt.widths_W.at[width].add(1))
        state = state.replace(cache=cache, key=key, draft_state=draft_state, rule_state=rule_state, adapt=adapt)
        return self._commit_round(state, live_B, drafts_BK, num_draft_B, n_B, next_B, counts)

    def _commit_round(self, state: LoopState, live_B, drafts_BK, num_draft_B, n_B, next_B, counts) -> LoopState:
        """The end of a speculative round (fixed or adaptive), `state` already holding the round's cache,
        key, drafter and rule states: each live row emits d[:n] + [next], the counters add the round."""
        K = drafts_BK.shape[1]
        drafts_BR = jnp.concatenate([drafts_BK, jnp.zeros_like(drafts_BK[:, :1])], axis=1)
        block_BR = jnp.where(jnp.arange(K + 1)[None] < n_B[:, None], drafts_BR, next_B[:, None])
        state = state.replace(draft_state=self._shard("draft_cache", state.draft_state))
        state, emitted_B = self.commit(state, block_BR, n_B + 1, n_B + 1)
        counters = state.counters.update(live_B=live_B, emitted_B=emitted_B, n_B=n_B, num_draft_B=num_draft_B,
                                         counts=counts)
        return state.replace(counters=counters)

    def score(self, params: Params, fed_BR, cache, width):
        """The target's logits on the first `width` fed positions, padded to R = K + 1 rows, their
        keys and values (a `llama.NewKV` padded to R positions, for `llama.write_kv`: the cache is
        only read, as XLA would copy it into each `lax.switch` branch that wrote it) and its
        features there for a feature drafter (else None).

        A drafter may propose fewer than K tokens (prompt lookup, often none at all):
        on a CPU a 9-position forward costs about twice a 1-position one, so the
        forward runs at the smallest compiled width that covers every live row.
        Padding rows lie past each row's num_draft, where no rule reads.
        `width` is rounded up to the next of `verify_widths`.
        """
        R = fed_BR.shape[1]
        widths = verify_widths(R - 1)

        def at(w):
            def run(fed_BR, cache):
                logits_BWV, feats_BWD, kv = self.forward(params, fed_BR[:, :w], cache, write=False)
                logits_BRV = _pad_positions(logits_BWV, R)
                return self._shard("logits", logits_BRV), _pad_positions(kv, R), _pad_positions(feats_BWD, R)
            return run

        if len(widths) == 1:
            return at(R)(fed_BR, cache)
        branch = jnp.searchsorted(jnp.asarray(widths), width)
        return jax.lax.switch(branch, [at(w) for w in widths], fed_BR, cache)

    def commit(self, state: LoopState, block_BJ, count_B, advance_B) -> tuple[LoopState, jax.Array]:
        """Emits `block_BJ[b, :count_B[b]]` for each live row and moves its cache pointer;
        returns the new state and the tokens each row emitted.

        The count is cut at `max_new_tokens` and just after the first EOS, so no row
        ever emits past either. `advance_B` is how many fed tokens the cache keeps
        (the pending token plus the accepted drafts); the last emitted token becomes
        the new pending one.
        """
        B, J = block_BJ.shape
        live_B = ~state.done_B
        j_J = jnp.arange(J, dtype=jnp.int32)
        count_B = jnp.minimum(count_B, self.max_new_tokens - state.num_out_B)
        if self.eos_ids:
            is_eos_BJ = jnp.isin(block_BJ, jnp.asarray(self.eos_ids, jnp.int32)) & (j_J[None] < count_B[:, None])
            first_eos_B = jnp.where(is_eos_BJ.any(-1), jnp.argmax(is_eos_BJ, axis=-1), J)
            hit_eos_B = first_eos_B < count_B
            count_B = jnp.minimum(count_B, first_eos_B + 1)
        else:
            hit_eos_B = jnp.zeros((B,), bool)
        count_B = jnp.where(live_B, count_B, 0)
        S = state.seq_BS.shape[1]
        start_B = state.prompt_len_B + state.num_out_B
        pos_BJ = jnp.where(j_J[None] < count_B[:, None], start_B[:, None] + j_J[None], S)  # S: dropped
        num_out_B = state.num_out_B + count_B
        state = state.replace(
            cache=state.cache._replace(lengths=state.cache.lengths + jnp.where(live_B, advance_B, 0)),
            seq_BS=state.seq_BS.at[jnp.arange(B)[:, None], pos_BJ].set(block_BJ, mode="drop"),
            num_out_B=num_out_B,
            done_B=state.done_B | (live_B & (hit_eos_B | (num_out_B >= self.max_new_tokens))),
        )
        return state, count_B


def pending(state: LoopState) -> jax.Array:
    """Each row's pending token: emitted, not yet seen by the target. int32[B]."""
    return jnp.take_along_axis(state.seq_BS, state.cache.lengths[:, None], axis=1)[:, 0]


def verify_widths(K: int) -> tuple[int, ...]:
    """Compiled widths of the target's verify forward: 1, about half, and K + 1.

    Each width is one more copy of the target forward in the program (compile time);
    1 covers rounds with nothing proposed, the middle one short proposals.
    """
    return tuple(sorted({1, K // 2 + 1, K + 1}))


def adaptive_widths(K: int) -> tuple[int, ...]:
    """Compiled widths of the adaptive loop: 1, 2, 3, 5, 9, 16, 32 up to K + 1, and K + 1 itself.

    Steps of about twice the width: the policy can halve or double a round (one more copy of
    the target forward per step, log K in all), and short drafts, where most of the expected
    gain lies, get every width."""
    return tuple(sorted({w for w in (1, 2, 3, 5, 9, 16, 32, 64) if w <= K + 1} | {K + 1}))


def _pad_positions(x, R: int):
    """`x` ([B, T, ...] arrays, or a `llama.NewKV` of [N, B, T, ...] ones, or None) zero-padded to R positions."""
    if x is None:
        return None
    if isinstance(x, llama.NewKV):
        return llama.NewKV(*(jnp.pad(a, [(0, 0), (0, 0), (0, R - a.shape[2])] + [(0, 0)] * (a.ndim - 3)) for a in x))
    return jnp.pad(x, [(0, 0), (0, R - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _no_kv(cache: KVCache, R: int) -> llama.NewKV:
    """Zero keys and values of R positions: a branch that wrote its own in place hands these on."""
    return llama.NewKV(*(jnp.zeros(a.shape[:2] + (R,) + a.shape[3:], a.dtype) for a in (cache.k, cache.v)))


def _propose(drafter, draft_params, state: LoopState, key, temperature, backend):
    """The drafter's proposal and, per row, the level that proposed it (`Drafter.propose_levels`)."""
    return drafter.propose_levels(draft_params, state.draft_state, state.seq_BS, state.cache.lengths, key,
                                  temperature, backend=backend)


# --- what the loop counts, and the statistics of one call made from it ---


@struct.dataclass(kw_only=True)
class Counters:
    """What every round adds to; rows that are done add nothing."""

    rounds_B: jax.Array  # int32[B]: verification forwards in which the row was live
    round_tokens_B: jax.Array  # int32[B]: tokens emitted by rounds (the prefill's token excluded)
    accepted_K: jax.Array  # int32[K]: rounds (all rows) in which draft position i was accepted
    offered_K: jax.Array  # int32[K]: rounds (all rows) in which draft position i held a real draft
    num_loose_B: jax.Array  # int32[B]: mismatches a loose rule accepted
    examined_B: jax.Array  # int32[B]: those plus the mismatches that stopped a round
    spent_B: jax.Array  # float32[B]: ASD ledger charged

    @classmethod
    def zeros(cls, B: int, K: int) -> "Counters":
        zi = lambda n: jnp.zeros((n,), jnp.int32)  # noqa: E731
        return cls(rounds_B=zi(B), round_tokens_B=zi(B), accepted_K=zi(K), offered_K=zi(K), num_loose_B=zi(B),
                   examined_B=zi(B), spent_B=jnp.zeros((B,), jnp.float32))

    def update(self, *, live_B, emitted_B, n_B=None, num_draft_B=None, counts: RoundCounts | None = None):
        """One round: `emitted_B` tokens kept per row; for a speculative round also the
        accepted drafts `n_B`, the real drafts `num_draft_B` and the rule's `counts`."""
        out = self.replace(rounds_B=self.rounds_B + live_B, round_tokens_B=self.round_tokens_B + emitted_B)
        if n_B is None:
            return out
        i_K = jnp.arange(self.accepted_K.shape[0])
        return out.replace(
            accepted_K=self.accepted_K + jnp.sum(live_B[:, None] & (i_K[None] < n_B[:, None]), axis=0),
            offered_K=self.offered_K + jnp.sum(live_B[:, None] & (i_K[None] < num_draft_B[:, None]), axis=0),
            num_loose_B=self.num_loose_B + counts.num_loose_B,
            examined_B=self.examined_B + counts.examined_B,
            spent_B=self.spent_B + counts.spent_B)


def statistics(counters: Counters, rule_state: Any = (), widths_W: Any = ()) -> dict[str, Any]:
    """The statistics of one call (host values; lists per request or per draft position).
    widths_W: an adaptive program's rounds per verified width (`Output.widths_W`), else ()."""
    c = jax.tree.map(np.asarray, counters)
    rounds_B = c.rounds_B
    # tau per request = tokens emitted by rounds / rounds; a request finished by its
    # prefill token has no round and a tau of 0 by this definition.
    tau_B = np.where(rounds_B > 0, c.round_tokens_B / np.maximum(rounds_B, 1), 0.0)
    out = {
        "tau": float(tau_B.mean()) if tau_B.size else 0.0,
        "tau_per_request": tau_B.tolist(),
        "rounds": int(rounds_B.max(initial=0)),
        "rounds_per_request": rounds_B.tolist(),
        "round_tokens_per_request": c.round_tokens_B.tolist(),
    }
    if c.accepted_K.shape[0] == 0:  # target-only decoding
        return out
    loose, examined = int(c.num_loose_B.sum()), int(c.examined_B.sum())
    out.update({
        "accepted_per_round": float(c.accepted_K.sum() / max(int(rounds_B.sum()), 1)),
        "accepted_per_position": np.where(c.offered_K > 0, c.accepted_K / np.maximum(c.offered_K, 1), 0.0).tolist(),
        "accepted_counts_per_position": c.accepted_K.tolist(),
        "offered_per_position": c.offered_K.tolist(),
        "loose": loose,
        "loose_per_request": c.num_loose_B.tolist(),
        "mismatches_examined": examined,
        "examined_per_request": c.examined_B.tolist(),
        "loose_share": loose / examined if examined else 0.0,
        "ledger_spent_per_request": c.spent_B.tolist(),
    })
    if not isinstance(widths_W, tuple):  # rounds per verified width (index = width; 1: a plain step), their mean
        widths = np.asarray(widths_W)
        out["widths"] = widths.tolist()
        out["mean_width"] = float((widths * np.arange(widths.size)).sum() / max(int(widths.sum()), 1))
    if isinstance(rule_state, CSDMemory):
        out["csd_memory_filled"] = int(rule_state.filled)
        out["csd_memory_capacity"] = rule_state.capacity
        out["csd_memory_dropped"] = int(rule_state.dropped)
    return out
