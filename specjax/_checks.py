"""Checks of arguments that run before anything is compiled: the Engine's numbers and EOS ids,
the token ids `Model.logits` takes, and the hint of a rule state that does not match.

Each names the wrong argument. (The checks of a generation request, memory included, are in
`engine.py`, beside the one place that runs them.)
"""

from __future__ import annotations

import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.verify import _common


def engine_args(*, temperature, top_p, seed, eos_ids) -> None:
    fn = "Engine"
    _common.check_temperature(fn, temperature)  # NaN and inf included: NaN passes `temperature < 0`
    _common.check_number(fn, "top_p", top_p)
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"{fn}: seed must be an int in [0, 2**32), got {seed!r}")
    if eos_ids is not None:
        if isinstance(eos_ids, (str, bytes)) or not isinstance(eos_ids, (Sequence, np.ndarray)):
            raise ValueError(f"{fn}: eos_ids must be a sequence of token ids, got {eos_ids!r} "
                             "(a string would be read one character at a time)")
        for e in eos_ids:
            if not isinstance(e, numbers.Integral) or isinstance(e, bool) or e < 0:
                raise ValueError(f"{fn}: eos_ids must hold token ids (ints >= 0), got {e!r} in {eos_ids!r}")


def token_ids(fn: str, tokens, vocab_size: int) -> np.ndarray | jax.Array:
    """Integer ids in [0, vocab_size): an id >= V reads no embedding row (NaN logits), a negative one
    wraps around, and a float one would be truncated. A traced array is checked for its dtype only."""
    if isinstance(tokens, jax.core.Tracer) or (isinstance(tokens, jax.Array) and not tokens.is_fully_addressable):
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"{fn}: token ids must be integers, got {tokens.dtype}")
        return tokens
    arr = np.asarray(tokens)
    if arr.size and not (np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_):
        raise ValueError(f"{fn}: token ids must be integers, got {arr.dtype} values")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr.min() if arr.min() < 0 else arr.max()
        raise ValueError(f"{fn}: token id {int(bad)} at {tuple(int(i) for i in np.argwhere(arr == bad)[0])} is "
                         f"outside the vocabulary [0, {vocab_size})")
    return arr


def state_hint(method: str, want, got) -> str:
    """Why a given rule_state's array does not match (Engine._rule_state's error)."""
    if method == "asd":
        return "(ASD's per-request ledgers of a batch of another size?)"
    return ""
