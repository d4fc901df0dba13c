"""A draft model of another vocabulary (another model family), inside the compiled loop.

`CrossVocabDrafter` implements `drafters.Drafter`: the loop calls init/propose/observe as for any
drafter and never learns that the draft speaks other ids. Its params are the draft model's params
plus the `vocab_bridge.Bridge` tables (device arrays, program inputs like the weights; replicated
on a mesh), under the key "bridge". Its state (`CrossState`) is the draft's own KV cache, the
draft-id text of what the target has committed, and per row the sync point: how many of the
target's committed tokens are translated, and how many draft ids they became.

Each round, `propose`:

1. *sync*: translates the target tokens committed since the sync point (at most `window` of them)
   with `vocab_bridge.sync_to_draft`: only whole target tokens; a token the draft cannot spell is
   left out; what does not fit waits for the next round (the row proposes nothing until it has
   caught up, so a proposal always continues the committed text);
2. *feed*: runs the draft over its new ids from one position before them (that position is already
   in its cache: recomputing it is idempotent, and it yields the logits of the next id when nothing
   new came). New ids that repeat the last proposal's (the accepted part, translated back) are in
   the cache already, written by step 3 of the last round: the feed starts after them, so a round
   whose accepted tokens round-trip feeds two ids, as a same-vocabulary draft does. Entries past
   the row's draft length are stale, masked by position, never erased;
3. *draft*: `draft_steps` greedy steps of the draft (default K);
4. *translate*: `vocab_bridge.draft_to_target` re-cuts the proposal's bytes into at most K target
   ids; num_draft is how many it made.

Rejected drafts need no rollback: the next round resyncs from the target's committed tokens.
With a `lookup` (FLy's multi-level drafting, `("pld", Model)`), step 3 first checks prompt lookup's
proposal, translated to draft ids and fed with the new context in the same forward, keeps the
prefix the draft's own greedy choice agrees with, and extends it step by step.

Temperature > 0: the draft's choice is greedy and reported as a point mass (probs None). Speculative
sampling with a point-mass draft is lossless whatever rule chose the draft tokens (a draft d is kept
with probability p(d), else the residual p(x)/(1 - p(d)) over x != d is sampled: p(x) overall), so
exact verification stays lossless; the draft's distribution over its own vocabulary is never needed.

Lengths: the draft's cache holds `draft_len` = ceil(`len_ratio` * max_len) positions (a draft of a
smaller vocabulary spends more tokens on the same text; 1.25 by default), and its prefill reads the
first ceil(`prompt_ratio` * T) draft ids of the translated prompt (the rest, if any, is caught up a
window per round, proposing nothing meanwhile). A row whose draft context would outgrow the cache
stops proposing (its rounds are plain decoding steps), never writes out of bounds. `state_bytes`
is what the state takes (the Engine's memory check counts it). A caller's own draft prompt
(`Engine.generate(..., draft_prompts=)`) replaces the translated one: `init`'s draft_prompt_BT.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax import vocab_bridge
from specjax.models import llama
from specjax.models.config import Config
from specjax.models.model import Model


@struct.dataclass(kw_only=True)
class CrossState:
    cache: llama.KVCache  # the draft's cache; positions count draft ids
    dseq_BSd: jax.Array  # int32[B, Sd]: the committed text in draft ids (its first d_len_B[b] entries)
    t_sync_B: jax.Array  # int32[B]: target tokens of seq_BS translated into dseq so far
    d_len_B: jax.Array  # int32[B]: draft ids they became; the cache holds positions < d_len_B
    t_tail_B: jax.Array  # int32[B]: the next sync re-translates from this target token (the seam's tail) ...
    d_tail_B: jax.Array  # int32[B]: ... writing from this draft position
    prop_BD: jax.Array  # int32[B, Kd]: the last proposal's draft ids; slots < Kd - 1 are cached at d_len_B + slot


BRIDGE = "bridge"  # the params key of the tables (specjax.sharding replicates what lies under it)


def split_params(params) -> tuple[Any, vocab_bridge.Bridge]:
    """(the draft model's params, the bridge tables) of a CrossVocabDrafter's params."""
    return {k: v for k, v in params.items() if k != BRIDGE}, params[BRIDGE]


def draft_vocab_size(params) -> int:
    """The draft tokenizer's vocabulary size, read from the bridge's tables in a drafter's params."""
    bridge = params[BRIDGE]
    table = bridge.d2t_len_Vd if bridge.algorithm == "table" else bridge.draft_nb_Vd
    return int(table.shape[0])


def make_params(draft_params, bridge: vocab_bridge.Bridge):
    """The draft model's params with the tables beside them: the Engine's native packing and
    unrolling of the draft's layers keep the extra key."""
    return {**draft_params, BRIDGE: bridge}


@dataclasses.dataclass(frozen=True)
class CrossVocabDrafter:
    """A draft Model of another vocabulary, translated on the device (see the module doc).

    config/dtype: the draft model's. k: the most target tokens proposed per round. draft_steps: draft
    ids generated per round (None: k; a K-id proposal of a smaller vocabulary usually re-cuts into
    fewer than K target ids). window: target tokens translated per round at most (None: 2 (k + 1)),
    sync_cap: draft ids they may become (None: 2 (k + 1)). lookup: a `drafters.PromptLookup` for
    multi-level drafting, or None.
    """

    config: Config
    k: int
    dtype: Any = jnp.float32
    name: str = "cross-draft"
    draft_steps: int | None = None
    window: int | None = None
    sync_cap: int | None = None
    len_ratio: float = 1.25
    prompt_ratio: float = 1.25
    lookup: Any = None
    uses_features = False
    levels = 1  # drafters.Drafter's adaptive members (DrafterDefaults'; this module lies below drafters.py)
    truncated = None

    def propose_levels(self, *args, **kwargs):
        out = self.propose(*args, **kwargs)
        return (*out, jnp.zeros_like(out[1]))

    @property
    def kd(self) -> int:
        return self.draft_steps or self.k

    @property
    def n_window(self) -> int:
        return self.window or 2 * (self.k + 1)

    @property
    def cap(self) -> int:
        return self.sync_cap or 2 * (self.k + 1)

    def draft_len(self, max_len: int) -> int:
        return -(-math.ceil(self.len_ratio * max_len) // 16) * 16

    def state_bytes(self, batch: int, max_len: int) -> int:
        """Bytes of the state `init` allocates for a program of `max_len` (eval_shape: no work): the
        draft's KV cache and id text at `draft_len(max_len)` positions, and the per-row counters."""
        Sd = self.draft_len(max_len)
        cache = jax.eval_shape(lambda: llama.init_cache(self.config, batch, Sd, self.dtype))
        leaves = jax.tree.leaves(cache) + [jax.ShapeDtypeStruct((batch, Sd), jnp.int32),
                                           jax.ShapeDtypeStruct((batch, self.kd), jnp.int32)] + [
            jax.ShapeDtypeStruct((batch,), jnp.int32)] * 4
        return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)

    # -- Drafter ---------------------------------------------------------------------------

    def init(self, params, prompt_BT, prompt_len_B, max_len, *, features_BTD=None, backend=None,
             draft_prompt_BT=None, draft_prompt_len_B=None) -> CrossState:
        """The draft's state after the prompts: their translation, or `draft_prompt_BT` (the same
        conversation rendered by the draft's own chat template, in its ids) when given."""
        model_params, bridge = split_params(params)
        B, T = prompt_BT.shape
        Sd = self.draft_len(max_len)
        if draft_prompt_BT is None:
            C0 = min(Sd, math.ceil(self.prompt_ratio * T))
            ids_BC, count_B, adv_B, tail_t_B, tail_d_B = jax.vmap(
                lambda i, n: vocab_bridge.sync_to_draft(bridge, i, n, C0, with_tail=True))(prompt_BT, prompt_len_B)
        else:  # the whole target prompt counts as translated: the rounds sync from its end (no seam)
            C0 = min(Sd, draft_prompt_BT.shape[1])
            ids_BC, count_B, adv_B = draft_prompt_BT[:, :C0], jnp.minimum(draft_prompt_len_B, C0), prompt_len_B
            tail_t_B, tail_d_B = adv_B, count_B
        dseq_BSd = jnp.zeros((B, Sd), jnp.int32).at[:, :C0].set(ids_BC)
        cache = llama.init_cache(self.config, B, Sd, self.dtype)
        # the whole translated prompt into the cache (positions past count_B are stale: masked later)
        _, cache = llama.forward_cached(self.config, model_params, ids_BC, cache, dtype=self.dtype,
                                        select_BJ=jnp.maximum(count_B - 1, 0)[:, None], backend=backend)
        return CrossState(cache=cache._replace(lengths=count_B), dseq_BSd=dseq_BSd, t_sync_B=adv_B, d_len_B=count_B,
                          t_tail_B=tail_t_B, d_tail_B=tail_d_B, prop_BD=jnp.full((B, self.kd), -1, jnp.int32))  # -1: no proposal yet, no id agrees

    def observe(self, state, features_BRD, base_B):
        return state

    def propose(self, params, state: CrossState, seq_BS, lengths_B, key, temperature, *, backend=None):
        model_params, bridge = split_params(params)
        B = seq_BS.shape[0]
        Sd = state.dseq_BSd.shape[1]
        K, Kd = self.k, self.kd
        old_len_B = state.d_len_B
        state, same_B = self.sync(bridge, state, seq_BS, lengths_B + 1)  # seq_BS[b, :L + 1] is committed
        caught_up_B = state.t_sync_B == lengths_B + 1
        d_len_B = state.d_len_B
        # the lookup's proposal (target ids) in draft ids, fed after the context in the same forward
        if self.lookup is not None:
            p_BK, np_B, _ = self.lookup.lookup(seq_BS, lengths_B)
            Kp = K
            pd_BP, mp_B, _ = jax.vmap(vocab_bridge.target_to_draft, in_axes=(None, 0, 0, None))(bridge, p_BK, np_B, Kp)
            mp_B = jnp.minimum(mp_B, Kd - 1)  # the draft's own token after them must fit
        else:
            Kp = 0
            pd_BP, mp_B = jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32)
        # feed [dseq[p0 .. d_len - 1], pd] at positions p0 .. ; p0 = one before the new ids that the cache
        # lacks: the last proposal's ids are cached from old_len on, so the new ids that repeat them (the
        # accepted part, when the round trip through the target's ids gives the draft's own ids back)
        # need no recomputing, and a round usually feeds two ids, as a same-vocabulary draft does
        # (where the re-translated seam changed ids the cache holds, from the first changed one)
        p0_B = jnp.maximum(jnp.where(same_B < old_len_B, same_B, old_len_B + self.agreed(state, old_len_B, Sd)) - 1, 0)
        W = self.cap + 1 + Kp
        t_BJ, cache = self.feed(model_params, state, p0_B, d_len_B, pd_BP, W, backend)
        j_D = jnp.arange(Kd)
        if Kp:
            agree_BP = (pd_BP == t_BJ[:, :Kp]) & (jnp.arange(Kp)[None] < mp_B[:, None])
            a_B = jnp.sum(jnp.cumprod(agree_BP, axis=1), axis=1).astype(jnp.int32)
            own_B = jnp.take_along_axis(t_BJ, a_B[:, None], axis=1)[:, 0]
            pd_BD = jnp.pad(pd_BP, ((0, 0), (0, max(Kd - Kp, 0))))[:, :Kd]
            d_BD = jnp.where(j_D[None] < a_B[:, None], pd_BD, jnp.where(j_D[None] == a_B[:, None], own_B[:, None], 0))
        else:
            a_B = jnp.zeros((B,), jnp.int32)
            d_BD = jnp.where(j_D[None] == 0, t_BJ[:, :1], 0)
        d_BD, cache = self.extend(model_params, d_BD, a_B + 1, d_len_B, cache, backend)
        ids_BK, count_B, _ = jax.vmap(vocab_bridge.draft_to_target, in_axes=(None, 0, None, None))(
            bridge, d_BD, jnp.int32(Kd), K)
        fits_B = d_len_B + Kd + W <= Sd  # the next round's feed and this round's steps stay in the cache
        num_draft_B = jnp.where(caught_up_B & fits_B & (d_len_B > 0), count_B, 0).astype(jnp.int32)
        return ids_BK, num_draft_B, None, state.replace(cache=cache._replace(lengths=d_len_B), prop_BD=d_BD)

    # -- pieces ----------------------------------------------------------------------------

    def agreed(self, state: CrossState, old_len_B, Sd: int):
        """How many of each row's ids synced this round (from old_len) equal the last proposal's first
        ids, whose keys and values the draft's cache already holds at those positions (slots < Kd - 1;
        the last slot was never fed). 0 where the proposal ran past the cache's end."""
        Kd = self.kd
        j_D = jnp.arange(Kd - 1)
        new_BD = jnp.take_along_axis(state.dseq_BSd, jnp.minimum(old_len_B[:, None] + j_D[None], Sd - 1), axis=1)
        same_BD = (new_BD == state.prop_BD[:, :Kd - 1]) & (old_len_B[:, None] + j_D[None] < state.d_len_B[:, None])
        m_B = jnp.sum(jnp.cumprod(same_BD, axis=1), axis=1).astype(jnp.int32)
        return jnp.where(old_len_B + Kd <= Sd, m_B, 0)

    def sync(self, bridge, state: CrossState, seq_BS, committed_B) -> tuple[CrossState, jax.Array]:
        """Translates up to `window` committed target tokens from each row's seam (the last synced
        target token, re-translated with the new ones so that the draft's ids merge across rounds as
        its tokenizer would) into draft ids -> (the state, per row the draft ids before the first one
        that changed: d_len where the seam re-translated as before)."""
        S, Sd = seq_BS.shape[1], state.dseq_BSd.shape[1]
        N, C = self.n_window, self.cap
        src_BN = jnp.take_along_axis(seq_BS, jnp.minimum(state.t_tail_B[:, None] + jnp.arange(N)[None], S - 1), axis=1)
        n_B = jnp.clip(committed_B - state.t_tail_B, 0, N)
        ids_BC, count_B, adv_B, tail_t_B, tail_d_B = jax.vmap(
            lambda i, n: vocab_bridge.sync_to_draft(bridge, i, n, C, with_tail=True))(src_BN, n_B)
        start_B = state.d_tail_B
        count_B = jnp.minimum(count_B, Sd - start_B)  # a full row keeps what fits (it proposes no more)
        c_C = jnp.arange(C)
        pos_BC = jnp.where(c_C[None] < count_B[:, None], start_B[:, None] + c_C[None], Sd)  # Sd: dropped
        old_BC = jnp.take_along_axis(state.dseq_BSd, jnp.minimum(start_B[:, None] + c_C[None], Sd - 1), axis=1)
        differ_BC = (c_C[None] < count_B[:, None]) & (start_B[:, None] + c_C[None] < state.d_len_B[:, None]) & (
            ids_BC != old_BC)
        same_B = jnp.min(jnp.where(differ_BC, start_B[:, None] + c_C[None], state.d_len_B[:, None]), axis=1)
        same_B = jnp.minimum(same_B, start_B + count_B)  # a seam that re-translated shorter
        B = seq_BS.shape[0]
        dseq_BSd = state.dseq_BSd.at[jnp.arange(B)[:, None], pos_BC].set(ids_BC, mode="drop")
        state = state.replace(dseq_BSd=dseq_BSd, t_sync_B=state.t_tail_B + adv_B, d_len_B=start_B + count_B,
                              t_tail_B=state.t_tail_B + tail_t_B, d_tail_B=start_B + jnp.minimum(tail_d_B, count_B))
        return state, same_B

    def feed(self, model_params, state: CrossState, p0_B, d_len_B, pd_BP, W: int, backend):
        """Runs the draft over [dseq[p0 .. d_len - 1], pd] from position p0: (its greedy choices after
        the context and after each of pd, int32[B, P + 1], the cache). Compiled at three widths
        (a forward's cost on a CPU grows with its width): 2 + P, K + 2 + P and W (see the ladder)."""
        Sd, Kp = state.dseq_BSd.shape[1], pd_BP.shape[1]
        need = jnp.max(d_len_B - p0_B) + Kp

        def at(width):
            def run(cache):
                w_W = jnp.arange(width)
                ctx_BW = jnp.take_along_axis(state.dseq_BSd, jnp.minimum(p0_B[:, None] + w_W[None], Sd - 1), axis=1)
                off_BW = w_W[None] - (d_len_B - p0_B)[:, None]  # index into pd
                tokens_BW = ctx_BW
                if Kp:
                    pd_BW = jnp.take_along_axis(pd_BP, jnp.clip(off_BW, 0, Kp - 1), axis=1)
                    tokens_BW = jnp.where((off_BW >= 0) & (off_BW < Kp), pd_BW, ctx_BW)
                select_BJ = jnp.clip((d_len_B - 1 - p0_B)[:, None] + jnp.arange(Kp + 1)[None], 0, width - 1)
                logits_BJV, cache = llama.forward_cached(self.config, model_params, tokens_BW,
                                                         cache._replace(lengths=p0_B), dtype=self.dtype,
                                                         select_BJ=select_BJ, backend=backend)
                return jnp.argmax(logits_BJV, axis=-1).astype(jnp.int32), cache
            return run

        # the ladder of widths: 2 (+ P) is a round whose accepted ids were cached (the correction and
        # the id before it), K + 2 (+ P) a round's usual new ids, W all of them
        widths = sorted({min(w, W) for w in (2 + Kp, self.k + 2 + Kp, W)})
        if len(widths) == 1:
            return at(W)(state.cache)
        index = jnp.sum(need > jnp.asarray(widths[:-1])).astype(jnp.int32)
        return jax.lax.switch(index, [at(w) for w in widths], state.cache)

    def extend(self, model_params, d_BD, c_B, d_len_B, cache, backend):
        """Fills draft slots c_B .. Kd - 1 of each row with the draft's greedy choices, one step at a
        time (slot c is read at position d_len + c - 1, after the slot before it)."""
        Kd = d_BD.shape[1]
        j_D = jnp.arange(Kd)

        def more(carry):
            return jnp.any(carry[1] < Kd)

        def step(carry):
            d_BD, c_B, cache = carry
            prev_B = jnp.take_along_axis(d_BD, jnp.clip(c_B - 1, 0, Kd - 1)[:, None], axis=1)[:, 0]
            logits_B1V, cache = llama.forward_cached(self.config, model_params, prev_B[:, None],
                                                     cache._replace(lengths=d_len_B + c_B - 1), dtype=self.dtype,
                                                     backend=backend)
            next_B = jnp.argmax(logits_B1V[:, 0], axis=-1).astype(jnp.int32)
            fill_BD = (j_D[None] == c_B[:, None]) & (c_B[:, None] < Kd)
            return jnp.where(fill_BD, next_B[:, None], d_BD), c_B + 1, cache

        d_BD, _, cache = jax.lax.while_loop(more, step, (d_BD, c_B, cache))
        return d_BD, cache


# -- building it from two models ------------------------------------------------------------

def same_vocab(target: Model, draft: Model) -> bool:
    """Whether the draft shares the target's vocabulary: the same size and, where both models
    have a tokenizer, the same tokens (without tokenizers, the same size is taken as the same)."""
    if target.config.vocab_size != draft.config.vocab_size:
        return False
    same = _same_tokens(target.tokenizer, draft.tokenizer)
    return same is None or same


def _same_tokens(tt, dt) -> bool | None:
    """Whether two tokenizers have the same tokens; None where either has no vocabulary to compare."""
    if getattr(tt, "backend", None) is None or getattr(dt, "backend", None) is None:
        return None
    return tt.backend.get_vocab() == dt.backend.get_vocab()


def from_models(target: Model, draft: Model, k: int, lookup=None):
    """(CrossVocabDrafter, its params) for a draft of another vocabulary (`drafters.from_spec`): the
    bridge's tables are built from both tokenizers (an error naming both models, before anything
    compiles, when either cannot be mapped). lookup: a `drafters.PromptLookup` (multi-level)."""
    if _same_tokens(target.tokenizer, draft.tokenizer):  # one tokenizer, embedding tables of two widths
        raise ValueError(f"the draft {draft.name} has the target {target.name}'s tokenizer but an embedding table "
                         f"of {draft.config.vocab_size} rows where the target has {target.config.vocab_size}: pad "
                         "the narrower one (models.pad_vocab) instead of translating between equal vocabularies")
    tname, dname = target.name or "the target", draft.name or "the draft"
    vocab_bridge.check_bridgeable(target.tokenizer, draft.tokenizer, target_name=tname, draft_name=dname)
    for side, who, tok, cfg in (("target", tname, target.tokenizer, target.config),
                                ("draft", dname, draft.tokenizer, draft.config)):
        # fewer tokens than embeddings is fine (Qwen2.5's padding rows are never chosen); more is not
        if tok.vocab_size > cfg.vocab_size:
            raise ValueError(f"{side} {who}: its tokenizer has "
                             f"{tok.vocab_size} tokens, more than its model's {cfg.vocab_size} embeddings")
    bridge = vocab_bridge.build_bridge(target.tokenizer, draft.tokenizer, target_name=tname, draft_name=dname)
    name = (draft.name or "draft") if lookup is None else f"pld+{draft.name or 'draft'}"
    drafter = CrossVocabDrafter(draft.config, k, draft.dtype, name, lookup=lookup)
    return drafter, make_params(draft.params, bridge)
