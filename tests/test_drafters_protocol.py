"""The adaptive loop's members of `drafters.Drafter` (levels, propose_levels, truncated): every kind
has them, so the loop never asks which kind a drafter is."""

import jax.numpy as jnp
import numpy as np

from specjax import drafters
from specjax.cross_draft import CrossVocabDrafter
from specjax.models import Config, feature_draft

TINY = Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8, rope_theta=300.0)
K = 4


def every_kind():
    lookup = drafters.PromptLookup(K)
    model = drafters.ModelDrafter(TINY, K)
    feature = drafters.FeatureDrafter(feature_draft.layer_config(TINY), K)
    return [lookup, model, drafters.MultiLevel(model, lookup), feature, drafters.LookupFirst(feature, lookup),
            CrossVocabDrafter(TINY, K), CrossVocabDrafter(TINY, K, lookup=lookup)]


def test_every_kind_has_the_adaptive_members():
    for d in every_kind():
        assert isinstance(d, drafters.Drafter), type(d)
        assert isinstance(d.levels, int) and d.levels >= 1, type(d)
        assert callable(d.propose_levels), type(d)
        if d.truncated is not None:  # a drafter whose steps cost: the same kind, proposing fewer
            short = d.truncated(2)
            assert type(short) is type(d) and short.k == 2 and d.k == K
    cut = {type(d).__name__ for d in every_kind() if d.truncated is not None}
    assert cut == {"ModelDrafter", "MultiLevel"}  # the lookup and the feature drafts always draft K
    assert drafters.MultiLevel(drafters.ModelDrafter(TINY, K), drafters.PromptLookup(K)).truncated(2).lookup.k == 2
    assert {d.levels for d in every_kind()} == {1, 2, 4}  # 4: the lookup's n-gram lengths (4 down to 1)

    class Missing:  # a drafter without them does not pass as one
        k, name, uses_features = K, "x", False

        def init(self, *a, **kw): ...

        def propose(self, *a, **kw): ...

        def observe(self, *a, **kw): ...

    assert not isinstance(Missing(), drafters.Drafter)


def test_default_propose_levels_is_propose_at_level_zero():
    class Fixed(drafters.DrafterDefaults):  # a drafter with only `propose`: the defaults do the rest
        k, name, uses_features = 3, "fixed", False

        def propose(self, params, state, seq_BS, lengths_B, key, temperature, *, backend=None):
            return seq_BS[:, :3], lengths_B, None, state

    seq_BS = jnp.array([[5, 6, 7, 5, 6, 0, 0, 0], [1, 2, 3, 4, 9, 0, 0, 0]], jnp.int32)
    lengths_B = jnp.array([4, 2], jnp.int32)
    plain = Fixed().propose((), (), seq_BS, lengths_B, None, 0.0)
    levels = Fixed().propose_levels((), (), seq_BS, lengths_B, None, 0.0)
    assert Fixed.levels == 1 and Fixed.truncated is None and len(levels) == 5
    for a, b in zip(plain, levels[:4]):
        np.testing.assert_array_equal(np.asarray(a) if a is not None else a, np.asarray(b) if b is not None else b)
    np.testing.assert_array_equal(levels[4], [0, 0])
    assert levels[4].dtype == jnp.int32


def test_prompt_lookup_propose_levels_is_propose_with_the_match_length():
    lookup = drafters.PromptLookup(K)
    seq_BS = jnp.array([[5, 6, 7, 5, 6, 0, 0, 0], [1, 2, 3, 4, 9, 0, 0, 0]], jnp.int32)
    lengths_B = jnp.array([4, 4], jnp.int32)
    plain = lookup.propose((), (), seq_BS, lengths_B, None, 0.0)
    levels = lookup.propose_levels((), (), seq_BS, lengths_B, None, 0.0)
    for a, b in zip(plain, levels[:4]):
        np.testing.assert_array_equal(np.asarray(a) if a is not None else a, np.asarray(b) if b is not None else b)
    np.testing.assert_array_equal(levels[1], [3, 0])  # row 0 matched "5 6" (then 7 5 6), row 1 nothing
    np.testing.assert_array_equal(levels[4], [2, 0])  # a 2-gram: level 4 - 2; no match: level 0
    assert levels[4].dtype == jnp.int32
