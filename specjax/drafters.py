"""Drafters: what proposes the K tokens that the target verifies.

`from_spec(draft, target, k)` turns the Engine's `draft` argument (None, "pld",
"self:N", a Model, ("pld", Model), a FeatureDraft) into a drafter and its parameters.
Every drafter is a frozen dataclass of static settings that implements `Drafter`
(below, the one statement of the contract); the loop calls its methods and never
asks which kind it is.

`seq_BS` holds every row's committed tokens (prompt, then emitted ones) and
`lengths_B` (L per row) indexes each row's pending token: the last emitted one, which the target
has not seen yet. A drafter with a KV cache re-feeds the two tokens at L-1 and
L each round: position L-1 is already in its cache (recomputing it is
idempotent), and this covers both catch-up cases at once (after a rejection
only the correction token is new; after a full acceptance, d[K-1] and the
bonus token are) without per-row bookkeeping. Entries past a row's committed
length are stale and masked by position, never erased.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct

from specjax import cross_draft
from specjax.verify._common import tempered
from specjax.models import feature_draft, llama
from specjax.models.config import Config
from specjax.models.model import Model

@runtime_checkable
class Drafter(Protocol):
    """The contract every drafter implements (PromptLookup, ModelDrafter, MultiLevel, FeatureDrafter,
    LookupFirst). Shapes: docs/rules.md, shape legend (K = `k`).

    k: the most tokens proposed per round. name: shown in statistics and results.
    uses_features: whether the drafter reads the target's last-layer hidden states; the loop then
        computes them (`loop.Program.forward`) and hands them to `init` and `observe`; otherwise
        they are None.
    levels: how many kinds of proposal the drafter makes (`propose_levels`); the adaptive loop
        learns acceptance per level.
    truncated: None, or truncated(k) -> the same drafter proposing k <= K tokens from the same
        state, so that an adaptive round drafts only as many steps as it verifies (drafters whose
        steps cost: a draft model; the lookup's search costs nothing and has None).
    backend (every method that runs a model): the program's `specjax.backend.Backend`.
    `DrafterDefaults` gives levels = 1, propose_levels = propose with level 0, truncated = None.
    """

    k: int
    name: str
    uses_features: bool
    levels: int
    truncated: Callable[[int], "Drafter"] | None

    def init(self, params, prompt_BT, prompt_len_B, max_len: int, *, features_BTD=None, backend=None) -> Any:
        """The drafter's state after the prompts (a KV cache, or ()). features_BTD: the target's
        features of the prompt positions, or None."""

    def propose(self, params, state, seq_BS, lengths_B, key, temperature: float, *,
                backend=None) -> tuple[jax.Array, jax.Array, jax.Array | None, Any]:
        """(drafts int32[B, K], num_draft int32[B] (drafts past it are padding), draft probabilities
        float[B, K, V] or None for a point mass on each draft, new state)."""

    def observe(self, state, features_BRD, base_B) -> Any:
        """The state after the target scored R = K + 1 fed positions (fed position j of row b is
        base_B[b] + j), with their features (None unless `uses_features`)."""

    def propose_levels(self, params, state, seq_BS, lengths_B, key, temperature: float, *,
                       backend=None) -> tuple[jax.Array, jax.Array, jax.Array | None, Any, jax.Array]:
        """`propose`'s tuple and, per row, the level that proposed it: int32[B] in [0, levels)."""


class DrafterDefaults:
    """The `Drafter` members a drafter of one level, whose proposal is not cut short, need not write."""

    levels: ClassVar[int] = 1
    truncated: ClassVar[Any] = None

    def propose_levels(self, params, state, seq_BS, lengths_B, key, temperature, *, backend=None):
        out = self.propose(params, state, seq_BS, lengths_B, key, temperature, backend=backend)
        return (*out, jnp.zeros_like(out[1]))


class _Stateless(DrafterDefaults):
    """Defaults of the `Drafter` members a drafter without features does not need."""

    uses_features: ClassVar[bool] = False

    def observe(self, state, features_BRD, base_B):
        return state


SPECS = ("None", "a Model", "'pld'", "'self:N'", "('pld', Model)", "a FeatureDraft", "('pld', FeatureDraft)")


def from_spec(draft, target: Model, k: int, *, pld_match: str = "earliest", temperature: float = 0.0):
    """(drafter, draft params) for the Engine's `draft` argument; (None, ()) for target-only decoding.

    draft: None, "pld" (prompt lookup), "self:N" (the target's first N layers), a Model
    (sharing the target's vocabulary, or of another byte-level BPE vocabulary: then a
    `cross_draft.CrossVocabDrafter`), ("pld", Model) (FLy's multi-level drafting, T = 0), a
    models.FeatureDraft (reads the target's last-layer features), or ("pld", FeatureDraft)
    (the lookup's continuation where it matches, the feature draft's elsewhere; T = 0).
    """
    if draft is None:
        return None, ()
    if isinstance(draft, str) and draft == "pld":
        return PromptLookup(k, match=pld_match), ()
    if isinstance(draft, str) and draft.startswith("self:"):
        draft = self_draft_model(target, draft[len("self:"):])
    if isinstance(draft, Model) and not cross_draft.same_vocab(target, draft):
        return cross_draft.from_models(target, draft, k)
    if isinstance(draft, Model):
        check_vocab(target, draft)
        return ModelDrafter(draft.config, k, draft.dtype, draft.name or "draft"), draft.params
    if isinstance(draft, feature_draft.FeatureDraft):
        feature_draft.check_target(target.config, draft)
        drafter = FeatureDrafter(draft.config, k, draft.dtype, draft.name)
        # the target's embedding table is shared, not copied: the same buffer in both trees
        return drafter, {"net": draft.params, "vocab_ids": jnp.asarray(draft.vocab_ids, jnp.int32),
                         "embed": target.params["embed"]}
    if isinstance(draft, tuple) and len(draft) == 2 and draft[0] == "pld" and isinstance(draft[1], feature_draft.FeatureDraft):
        if temperature > 0:
            raise ValueError("('pld', FeatureDraft) is a temperature-0 drafter")
        model, params = from_spec(draft[1], target, k)
        return LookupFirst(model, PromptLookup(k, match=pld_match)), params
    if isinstance(draft, tuple) and len(draft) == 2 and draft[0] == "pld" and isinstance(draft[1], Model):
        if temperature > 0:
            raise ValueError("multi-level drafting ('pld', Model) is a temperature-0 drafter")
        if not cross_draft.same_vocab(target, draft[1]):
            return cross_draft.from_models(target, draft[1], k, lookup=PromptLookup(k, match=pld_match))
        check_vocab(target, draft[1])
        model = ModelDrafter(draft[1].config, k, draft[1].dtype, draft[1].name or "draft")
        return MultiLevel(model, PromptLookup(k, match=pld_match)), draft[1].params
    raise ValueError(f"unknown draft {draft!r:.80}; expected one of {', '.join(SPECS)}")


def self_draft_model(target: Model, num_layers) -> Model:
    """The target's first `num_layers` layers, with its embedding, final norm and head, as a Model."""
    n = str(num_layers)
    if not n.isdigit() or not 1 <= int(n) < target.config.num_layers:
        raise ValueError(f"draft 'self:{n}': N must be an integer in [1, {target.config.num_layers - 1}]")
    config = dataclasses.replace(target.config, num_layers=int(n))
    return Model(config, self_draft_params(target.params, int(n)), target.tokenizer, f"self:{n}", target.dtype)


def check_vocab(target: Model, draft: Model) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"vocabulary mismatch between draft ({dv} tokens) and target ({tv} tokens): "
                         "a draft model must share the target's tokenizer")
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None and tt.backend.get_vocab() != dt.backend.get_vocab():
        raise ValueError("vocabulary mismatch between draft and target: same size, different tokens")


def _choose(key, logits_BV, temperature):
    """Greedy at T = 0 (probs None: a point mass); else a sample and the distribution it came from."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
    scaled_BV = tempered(logits_BV, temperature)
    return jax.random.categorical(key, scaled_BV, axis=-1).astype(jnp.int32), jax.nn.softmax(scaled_BV, axis=-1)


def _last_two(seq_BS, lengths_B):
    """The tokens at L-1 and L (the pending token) of each row: int32[B, 2]."""
    return jnp.take_along_axis(seq_BS, jnp.stack([lengths_B - 1, lengths_B], axis=1), axis=1)


@dataclasses.dataclass(frozen=True)
class ModelDrafter(_Stateless):
    """A small model with the target's tokenizer; K sequential steps as a `scan`."""

    config: Config
    k: int
    dtype: Any = jnp.float32
    name: str = "draft"

    def init(self, params, prompt_BT, prompt_len_B, max_len, *, features_BTD=None, backend=None):
        B = prompt_BT.shape[0]
        cache = llama.init_cache(self.config, B, max_len, self.dtype)
        _, cache = llama.forward_cached(self.config, params, prompt_BT, cache, dtype=self.dtype,
                                        select_BJ=(prompt_len_B - 1)[:, None], backend=backend)
        return cache

    def propose(self, params, cache, seq_BS, lengths_B, key, temperature, *, backend=None):
        B = seq_BS.shape[0]
        keys = jax.random.split(key, self.k)
        cache = cache._replace(lengths=lengths_B - 1)
        logits_B1V, cache = llama.forward_cached(self.config, params, _last_two(seq_BS, lengths_B), cache,
                                                 dtype=self.dtype, select_BJ=jnp.ones((B, 1), jnp.int32),
                                                 backend=backend)
        cache = cache._replace(lengths=lengths_B + 1)
        d0_B, q0_BV = _choose(keys[0], logits_B1V[:, 0], temperature)

        def step(carry, key):
            d_B, cache = carry
            logits_B1V, cache = llama.forward_cached(self.config, params, d_B[:, None], cache, dtype=self.dtype,
                                                     backend=backend)
            cache = cache._replace(lengths=cache.lengths + 1)
            d_B, q_BV = _choose(key, logits_B1V[:, 0], temperature)
            return (d_B, cache), (d_B, q_BV)

        (_, cache), (rest_KB, q_KBV) = jax.lax.scan(step, (d0_B, cache), keys[1:])
        drafts_BK = jnp.concatenate([d0_B[:, None], rest_KB.T], axis=1)
        probs_BKV = None
        if temperature > 0:
            probs_BKV = jnp.concatenate([q0_BV[:, None], jnp.moveaxis(q_KBV, 0, 1)], axis=1)
        return drafts_BK, jnp.full((B,), self.k, jnp.int32), probs_BKV, cache

    def truncated(self, k: int) -> "ModelDrafter":
        """This drafter proposing k tokens (its cache does not depend on k)."""
        return dataclasses.replace(self, k=k)


def self_draft_params(params, num_layers: int):
    """The target's first `num_layers` layers with its own embedding, final norm and head."""
    out = dict(params)
    out["layers"] = jax.tree.map(lambda x: x[:num_layers], params["layers"])
    return out


@dataclasses.dataclass(frozen=True)
class PromptLookup(_Stateless):
    """Prompt-lookup decoding: the continuation of the longest n-gram (max_ngram down to
    min_ngram) that ends at the pending token and occurred earlier in the row's tokens.

    match="earliest" takes its first occurrence (as FLy's code does), "latest" the most
    recent one. No match proposes nothing (num_draft = 0): the round is then a plain
    decoding step, and the engine scores a single position.

    Levels (for the adaptive loop's acceptance counts): the length of the n-gram matched, level 0
    the longest (max_ngram). A one-token match (the pending token seen before) is kept far less
    often than a four-token one, and counted apart the loop learns to verify each as it pays.
    """

    k: int
    max_ngram: int = 4
    min_ngram: int = 1
    match: str = "earliest"
    name: str = "pld"

    def init(self, params, prompt_BT, prompt_len_B, max_len, *, features_BTD=None, backend=None):
        return ()

    @property
    def levels(self) -> int:
        return self.max_ngram - self.min_ngram + 1

    def lookup(self, seq_BS, lengths_B):
        """(drafts int32[B, K], num_draft int32[B], found bool[B])."""
        return jax.vmap(self._row)(seq_BS, lengths_B)[:3]

    def propose_levels(self, params, state, seq_BS, lengths_B, key, temperature, *, backend=None):
        drafts_BK, num_draft_B, _, n_B = jax.vmap(self._row)(seq_BS, lengths_B)
        return drafts_BK, num_draft_B, None, state, (self.max_ngram - n_B).astype(jnp.int32)

    def _row(self, seq_S, L):
        """One row's lookup: drafts, num_draft, found, and the length of the n-gram matched (max_ngram
        where nothing matched, so that level 0 stands for the rows that proposed nothing too)."""
        S = seq_S.shape[0]
        j_S = jnp.arange(S)
        best_start, best_found, best_n = jnp.int32(0), jnp.bool_(False), jnp.int32(self.max_ngram)
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer n-grams overwrite shorter ones
            hit_S = (j_S + n <= L) & (L - n + 1 >= 0)  # a match ends before the suffix itself
            for t in range(n):
                hit_S &= jnp.take(seq_S, jnp.minimum(j_S + t, S - 1)) == jnp.take(seq_S, jnp.maximum(L - n + 1 + t, 0))
            found = hit_S.any()
            if self.match == "earliest":
                start = jnp.argmax(hit_S)
            else:
                start = S - 1 - jnp.argmax(hit_S[::-1])
            best_start = jnp.where(found, start + n, best_start)
            best_n = jnp.where(found, n, best_n)
            best_found |= found
        idx_K = jnp.minimum(best_start + jnp.arange(self.k), S - 1)
        drafts_K = jnp.where(best_found, jnp.take(seq_S, idx_K), jnp.take(seq_S, L))
        num_draft = jnp.where(best_found, jnp.clip(L + 1 - best_start, 1, self.k), 0)
        return drafts_K.astype(jnp.int32), num_draft.astype(jnp.int32), best_found, best_n

    def propose(self, params, state, seq_BS, lengths_B, key, temperature, *, backend=None):
        drafts_BK, num_draft_B, _ = self.lookup(seq_BS, lengths_B)
        return drafts_BK, num_draft_B, None, state


@dataclasses.dataclass(frozen=True)
class MultiLevel(_Stateless):
    """FLy's multi-level drafting: prompt lookup proposes, the draft model checks the
    proposal in one forward (keeping the prefix its own greedy choice agrees with) and
    extends it step by step, so the draft model runs fewer sequential steps.
    Temperature 0 only."""

    model: ModelDrafter
    lookup: PromptLookup
    name: str = "pld+draft"
    levels: ClassVar[int] = 2  # 0: the lookup found a match (its tokens, checked and extended); 1: the model alone

    @property
    def k(self) -> int:
        return self.model.k

    def truncated(self, k: int) -> "MultiLevel":
        return dataclasses.replace(self, model=self.model.truncated(k), lookup=dataclasses.replace(self.lookup, k=k))

    def init(self, params, prompt_BT, prompt_len_B, max_len, *, features_BTD=None, backend=None):
        return self.model.init(params, prompt_BT, prompt_len_B, max_len, backend=backend)

    def propose(self, params, cache, seq_BS, lengths_B, key, temperature, *, backend=None):
        return self.propose_levels(params, cache, seq_BS, lengths_B, key, temperature, backend=backend)[:4]

    def propose_levels(self, params, cache, seq_BS, lengths_B, key, temperature, *, backend=None):
        K, cfg, dtype = self.k, self.model.config, self.model.dtype
        B = seq_BS.shape[0]
        p_BK, np_B, found_B = self.lookup.lookup(seq_BS, lengths_B)
        # one draft forward over [seq[L-1], pending, p_0 .. p_{K-1}] at positions L-1 ..
        tokens = jnp.concatenate([_last_two(seq_BS, lengths_B), p_BK], axis=1)
        logits_BRV, cache = llama.forward_cached(cfg, params, tokens, cache._replace(lengths=lengths_B - 1), dtype=dtype,
                                                 backend=backend)
        t_BR = jnp.argmax(logits_BRV[:, 1:], axis=-1).astype(jnp.int32)  # draft's choice after pending, p_0, ...
        j_K = jnp.arange(K)
        agree_BK = (p_BK == t_BR[:, :K]) & (j_K[None] < np_B[:, None])
        a_B = jnp.sum(jnp.cumprod(agree_BK, axis=1), axis=1).astype(jnp.int32)  # PLD tokens the draft keeps
        own_B = jnp.take_along_axis(t_BR, a_B[:, None], axis=1)[:, 0]  # the draft's token after them
        drafts_BK = jnp.where(j_K[None] < a_B[:, None], p_BK, jnp.where(j_K[None] == a_B[:, None], own_B[:, None], 0))
        # positions <= L + a now hold [.., pending, p_0 .. p_{a-1}]; extend rows one token at a time
        c_B = a_B + 1  # next draft index to fill

        def more(carry):
            return jnp.any(carry[1] < K)

        def step(carry):
            drafts_BK, c_B, cache = carry
            prev_B = jnp.take_along_axis(drafts_BK, jnp.clip(c_B - 1, 0, K - 1)[:, None], axis=1)[:, 0]
            logits_B1V, cache = llama.forward_cached(cfg, params, prev_B[:, None],
                                                     cache._replace(lengths=lengths_B + c_B), dtype=dtype,
                                                     backend=backend)
            d_B = jnp.argmax(logits_B1V[:, 0], axis=-1).astype(jnp.int32)
            fill_BK = (j_K[None] == c_B[:, None]) & (c_B[:, None] < K)
            return jnp.where(fill_BK, d_B[:, None], drafts_BK), c_B + 1, cache

        drafts_BK, _, cache = jax.lax.while_loop(more, step, (drafts_BK, c_B, cache))
        return drafts_BK, jnp.full((B,), K, jnp.int32), None, cache, jnp.where(found_B, 0, 1).astype(jnp.int32)


@struct.dataclass(kw_only=True)
class FeatureState:
    cache: llama.KVCache  # the draft layer's keys and values (one layer)
    feat_BRD: jax.Array  # the target's features at the positions it last scored
    base_B: jax.Array  # int32[B]: position of feat_BRD[:, 0]


@dataclasses.dataclass(frozen=True)
class FeatureDrafter(DrafterDefaults):
    """A feature draft (`specjax.models.feature_draft`): K chained steps of one layer over the
    target's hidden states. Each round first re-feeds the K + 1 positions the target scored
    last, with their true features (the accepted ones are the row's new history; the rest is
    overwritten before anything reads it), then continues on its own predictions.

    Position j's input is (x_{j+1}, f_j): the pending token sits at L, so the round's first
    draft comes from position L - 1, which the last verification scored (base + n).
    """

    config: Config  # the draft layer (the target's shape, one layer)
    k: int
    dtype: Any = jnp.float32
    name: str = "feature-draft"
    uses_features: ClassVar[bool] = True

    def _embed(self, params, tokens_BT):
        return llama.embed_tokens(params["embed"], tokens_BT, self.dtype)

    def _choose(self, params, key, f_BD, temperature, backend=None):
        """(full-vocabulary token int32[B], probs over the full vocabulary or None)."""
        ids_Vd = params["vocab_ids"]  # the head's columns in the full vocabulary
        logits_BVd = feature_draft.logits(self.config, params["net"], f_BD, self.dtype, backend=backend)
        d_B, q_BVd = _choose(key, logits_BVd, temperature)
        q_BV = None
        if q_BVd is not None:  # zero outside the reduced vocabulary: the rules' residual covers it
            q_BV = jnp.zeros((f_BD.shape[0], self.config.vocab_size), q_BVd.dtype).at[:, ids_Vd].set(q_BVd)
        return jnp.take(ids_Vd, d_B), q_BV

    def init(self, params, prompt_BT, prompt_len_B, max_len, *, features_BTD, backend=None):
        B, T = prompt_BT.shape
        cache = llama.init_cache(self.config, B, max_len, self.dtype)
        # position j reads x_{j+1}: the last prompt position waits for the first emitted token
        next_BT = jnp.concatenate([prompt_BT[:, 1:], jnp.zeros_like(prompt_BT[:, :1])], axis=1)
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        _, cache = feature_draft.features(self.config, params["net"], self._embed(params, next_BT), features_BTD,
                                          positions_BT, cache, self.dtype, backend=backend)
        last_B = prompt_len_B - 1
        f_BD = jnp.take_along_axis(features_BTD, last_B[:, None, None], axis=1)[:, 0]
        feat_BRD = jnp.zeros((B, self.k + 1, self.config.hidden_size), self.dtype).at[:, 0].set(f_BD.astype(self.dtype))
        return FeatureState(cache=cache, feat_BRD=feat_BRD, base_B=last_B)

    def observe(self, state: FeatureState, features_BRD, base_B) -> FeatureState:
        return state.replace(feat_BRD=features_BRD.astype(self.dtype), base_B=base_B)

    def refeed(self, params, state: FeatureState, seq_BS, lengths_B, backend=None):
        """Writes the positions the target last scored (true features) into the draft's cache;
        returns the new state and the predicted feature of the pending position L: float[B, D]."""
        S = seq_BS.shape[1]
        pos_BR = state.base_B[:, None] + jnp.arange(self.k + 1, dtype=jnp.int32)[None]
        next_BR = jnp.take_along_axis(seq_BS, jnp.minimum(pos_BR + 1, S - 1), axis=1)
        f_BRD, cache = feature_draft.features(self.config, params["net"], self._embed(params, next_BR),
                                              state.feat_BRD, pos_BR, state.cache, self.dtype, backend=backend)
        at_B = lengths_B - 1 - state.base_B  # position L - 1 in this feed
        return state.replace(cache=cache), jnp.take_along_axis(f_BRD, at_B[:, None, None], axis=1)[:, 0]

    def propose(self, params, state: FeatureState, seq_BS, lengths_B, key, temperature, *, backend=None):
        state, f_BD = self.refeed(params, state, seq_BS, lengths_B, backend)
        return self.chain(params, state, f_BD, lengths_B, key, temperature, backend)

    def chain(self, params, state: FeatureState, f_BD, lengths_B, key, temperature, backend=None):
        """K drafts from the pending position's predicted feature, each step on the last one's."""
        B = f_BD.shape[0]
        cache = state.cache
        keys = jax.random.split(key, self.k)
        d0_B, q0_BV = self._choose(params, keys[0], f_BD, temperature, backend)

        def step(carry, xs):
            d_B, f_BD, cache = carry
            key, p = xs
            f_B1D, cache = feature_draft.features(self.config, params["net"], self._embed(params, d_B[:, None]),
                                                  f_BD[:, None], (lengths_B + p)[:, None], cache, self.dtype,
                                                  backend=backend)
            d_B, q_BV = self._choose(params, key, f_B1D[:, 0], temperature, backend)
            return (d_B, f_B1D[:, 0], cache), (d_B, q_BV)

        (_, _, cache), (rest_KB, q_KBV) = jax.lax.scan(step, (d0_B, f_BD, cache),
                                                       (keys[1:], jnp.arange(self.k - 1, dtype=jnp.int32)))
        drafts_BK = jnp.concatenate([d0_B[:, None], rest_KB.T], axis=1)
        probs_BKV = None
        if temperature > 0:
            probs_BKV = jnp.concatenate([q0_BV[:, None], jnp.moveaxis(q_KBV, 0, 1)], axis=1)
        return drafts_BK, jnp.full((B,), self.k, jnp.int32), probs_BKV, state.replace(cache=cache)


@dataclasses.dataclass(frozen=True)
class LookupFirst(DrafterDefaults):
    """Prompt lookup where it finds a match, the feature draft elsewhere: `("pld", FeatureDraft)`.

    FLy's multi-level check (`MultiLevel`: the draft model scores the lookup's proposal in one
    forward) does not carry over: a feature draft's step j reads its prediction for step j - 1,
    so checking K proposed tokens costs K sequential steps, as drafting does. Instead each row
    takes the lookup's proposal when there is one and the feature draft's otherwise; the draft's
    cache is refreshed every round (its next round must see this round's verified positions), and
    its K chained steps are skipped when every row has a match. Temperature 0 only.
    """

    model: FeatureDrafter
    lookup: PromptLookup
    name: str = "pld|feature"
    uses_features: ClassVar[bool] = True

    @property
    def k(self) -> int:
        return self.model.k

    def init(self, params, prompt_BT, prompt_len_B, max_len, *, features_BTD, backend=None):
        return self.model.init(params, prompt_BT, prompt_len_B, max_len, features_BTD=features_BTD, backend=backend)

    def observe(self, state, features_BRD, base_B):
        return self.model.observe(state, features_BRD, base_B)

    def propose(self, params, state, seq_BS, lengths_B, key, temperature, *, backend=None):
        p_BK, np_B, found_B = self.lookup.lookup(seq_BS, lengths_B)
        state, f_BD = self.model.refeed(params, state, seq_BS, lengths_B, backend)

        def chain(state):
            d_BK, _, _, state = self.model.chain(params, state, f_BD, lengths_B, key, 0.0, backend)
            return d_BK, state

        d_BK, state = jax.lax.cond(jnp.all(found_B), lambda st: (jnp.zeros_like(p_BK), st), chain, state)
        drafts_BK = jnp.where(found_B[:, None], p_BK, d_BK)
        num_draft_B = jnp.where(found_B, np_B, self.k).astype(jnp.int32)
        return drafts_BK, num_draft_B, None, state
