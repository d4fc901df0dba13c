"""Checks of a generation request that run before anything is compiled.

`Engine` calls these (one line each), so that a wrong argument gets an error that
names it, and a request that cannot fit in memory is refused with what does fit,
instead of failing inside XLA.
"""

from __future__ import annotations

import functools
import numbers
import os
import warnings
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


def positions(fn: str, config, used: int, what: str) -> None:
    """Warns when `used` positions pass the model's max_position_embeddings (never trained there)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and used > limit:
        warnings.warn(f"{fn}: {what} = {used} positions, more than the model's max_position_embeddings "
                      f"{limit}; positions past it were never trained, so the output there may be meaningless",
                      stacklevel=3)


def available_bytes() -> tuple[int, str]:
    """Memory free for new buffers on the default backend: (bytes, where)."""
    devices = jax.local_devices()
    stats = [d.memory_stats() if hasattr(d, "memory_stats") else None for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        free = sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        return free, f"{len(devices)} {devices[0].platform} device(s)"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, "host memory"
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "host memory"


@functools.lru_cache(maxsize=64)
def _bytes_per_position(configs: tuple, dtype, batch: int) -> int:
    """Bytes of the KV caches of `configs` and the int32 token buffer per cache position (eval_shape: no work)."""
    from specjax.models import llama

    def nbytes(config, length):
        shapes = jax.eval_shape(lambda: llama.init_cache(config, batch, length, dtype))
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    return batch * 4 + sum(nbytes(c, 2) - nbytes(c, 1) for c in configs)


def cache_fits(configs, dtype, batch: int, max_len: int, max_new_tokens: int) -> None:
    """Refuses, before compiling, KV caches (and the token buffer) larger than the memory left."""
    per_position = _bytes_per_position(tuple(configs), dtype, batch)
    need = per_position * max_len
    free, where = available_bytes()
    budget = int(0.9 * free)  # XLA's temporaries need some room too
    if need > budget:
        fits = max(0, budget // per_position - (max_len - max_new_tokens) - 64)
        raise ValueError(f"Engine: max_new_tokens={max_new_tokens} needs caches of max_len {max_len} for a batch "
                         f"of {batch}: {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free in "
                         f"{where}; at most about max_new_tokens={fits} fits (or use a smaller batch)")


def cache_configs(engine) -> list:
    """The configs whose KV caches a generation allocates: the target's and a draft model's."""
    drafter = getattr(engine.drafter, "model", engine.drafter)  # MultiLevel holds its model drafter
    draft = getattr(drafter, "config", None)
    return [engine.target.config] + ([draft] if draft is not None else [])


def state_hint(method: str, want, got) -> str:
    """Why a given rule_state's array does not match (Engine._rule_state's error)."""
    if method == "asd":
        return "(ASD's per-request ledgers of a batch of another size?)"
    return ""


def flag_invalid(out):
    """Counts the -1 tokens (rows of NaN / no finite logits, see verify's NAN_POLICY) per request in
    out.stats["invalid_logit_tokens"], and warns when there are any: such output is not to be trusted."""
    counts = [sum(1 for t in tokens if t < 0) for tokens in out.tokens]
    out.stats["invalid_logit_tokens"] = counts
    if any(counts):
        warnings.warn(f"Engine: the target's logits were invalid (NaN, inf, or no finite entry) at {sum(counts)} "
                      f"emitted position(s) of {sum(1 for c in counts if c)} request(s), marked by token -1; "
                      "the text after them is not meaningful (broken weights or inputs?)", RuntimeWarning,
                      stacklevel=3)
    return out
