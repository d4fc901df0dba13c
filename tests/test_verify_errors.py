"""Bad input raises a ValueError naming the problem, at trace time (before compilation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from specjax import verify

K, V = 3, 5
D = jnp.zeros((K,), jnp.int32)
L = jnp.zeros((K + 1, V))
KEY = jax.random.key(0)
MEMORY = verify.csd_memory(4)

CASES = [
    (lambda: verify.greedy(jnp.zeros((0,), jnp.int32), jnp.zeros((1, V))), "K = 0"),
    (lambda: verify.greedy(D, jnp.zeros((K, V))), r"has 3 rows, expected K\+1 = 4"),
    (lambda: verify.greedy(jnp.zeros((2, K), jnp.int32), L), r"int array \[K\] for one sequence"),
    (lambda: verify.greedy(jnp.zeros((K,)), L), "draft_tokens must be an int array"),
    (lambda: verify.greedy(D, jnp.zeros((K + 1, V), jnp.int32)), r"float array \[K\+1, V\]"),
    (lambda: verify.greedy(D, jnp.zeros((K + 1, 0))), "empty vocabulary"),
    (lambda: verify.greedy(D, L, num_draft=K + 1), "num_draft=4 outside"),
    (lambda: verify.greedy(D, L, num_draft=jnp.array([1, 2])), "num_draft must be an int scalar"),
    (lambda: verify.speculative_sampling(D, L, KEY, draft_probs=jnp.ones((K, V + 1))), "vocabulary mismatch"),
    (lambda: verify.speculative_sampling(D, L, KEY, draft_probs=jnp.ones((K + 1, V))), r"draft_probs must be \[K, V\]"),
    (lambda: verify.speculative_sampling(D, L, None), "needs a PRNG key"),
    (lambda: verify.speculative_sampling(D, L, KEY, temperature=-1.0), "temperature must be"),
    (lambda: verify.fly(D, L, entropy="foo"), "unknown entropy='foo'"),
    (lambda: verify.fly(D, L, rule="bar"), "unknown rule='bar'"),
    (lambda: verify.fly(D, L, window=-1), "window must be >= 0"),
    (lambda: verify.fly(D, L, window=0, rule="reference"), "window must be >= 1 for rule='reference'"),
    (lambda: verify.fly(D, L, window=2.5), "window must be an int"),
    (lambda: verify.fly(D, L, theta="high"), "theta must be a numeric scalar"),
    (lambda: verify.fly(D, L, temperature=1.0), "needs a PRNG key"),
    (lambda: verify.fly(D, L, temperature=1.0, key=KEY, draft_probs=jnp.ones((K, 2))), "vocabulary mismatch"),
    (lambda: verify.asd(D, L, 8.0, suffix="x"), "unknown suffix='x'"),
    (lambda: verify.asd(D, L, 8.0, temperature=0.7), "temperature-0 rule"),
    (lambda: verify.asd(D, L, 8.0, loose_mask=jnp.ones((K + 1,), bool)), r"loose_mask must be bool\[K\]"),
    (lambda: verify.asd(D, L, None), "budget_left must be a numeric scalar"),
    (lambda: verify.csd(D, L, {}), "CSDMemory"),
    (lambda: verify.csd(D, L, MEMORY, update="yes"), "update must be a static bool"),
    (lambda: verify.csd(D, L, MEMORY, tau=-1.0), "tau must be >= 0"),
    (lambda: verify.csd(D, L, MEMORY, temperature=1.0), "temperature-0 rule"),
    (lambda: verify.csd_batch(D, L, MEMORY), r"expected draft_tokens \[B, K\]"),
    (lambda: verify.csd_batch(D[None], L[None], MEMORY, num_draft=jnp.array([1, 2])),
     r"num_draft must be a scalar or \[B\]"),
    (lambda: verify.csd_count({}, 1, 2), "CSDMemory"),
    (lambda: verify.typical(D, L, KEY, epsilon="a"), "epsilon must be a numeric scalar"),
    (lambda: verify.typical(D, L, None, temperature=0.5), "needs a PRNG key"),
]


@pytest.mark.parametrize("call, match", CASES, ids=[m for _, m in CASES])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_errors_surface_while_tracing_under_jit():
    for rule in [lambda d, l: verify.fly(d, l, entropy="foo"), lambda d, l: verify.greedy(d, l[:-1]),
                 lambda d, l: verify.asd(d, l, 1.0, suffix="x")]:
        with pytest.raises(ValueError):
            jax.jit(rule).trace(D, L)  # tracing only: nothing is compiled
