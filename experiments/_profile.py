"""What experiments/profile_step.py measures with: XLA's per-operation times from a profiler trace, and
a decode step with one parameter tree per layer (no absl flags here, so tests import it freely)."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile


def profile_ops(fn, args, steps=10) -> list[tuple[str, float, float]]:
    """(operation name, ms per step, calls per step) of the compiled program, largest first."""
    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(steps):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))
        if not files:
            raise RuntimeError("the profiler wrote no trace")
        with gzip.open(files[-1]) as f:
            events = json.load(f)["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for e in events:  # the program's own operations (thunks); host-side Python frames start with "$"
        name = e.get("name", "")
        if e.get("ph") == "X" and not name.startswith("$") and "Thunk" not in name and "Execute" not in name \
                and "PjitFunction" not in name:
            total[name] += e["dur"] / 1e3
            calls[name] += 1
    return [(n, ms / steps, calls[n] / steps) for n, ms in total.most_common()]


def unrolled_forward(config, params, layers, tokens_BT, cache):
    """llama.forward_cached with one parameter tree per layer and a Python loop instead of the scan."""
    import jax.numpy as jnp

    from specjax.models import llama, quant

    positions_BT = cache.lengths[:, None] + jnp.arange(tokens_BT.shape[1])[None]
    embed = params["embed"]
    if isinstance(embed, quant.BlockQuant):
        x = quant.take_columns(embed, tokens_BT)
    else:
        x = jnp.moveaxis(jnp.take(embed, tokens_BT, axis=1), 0, -1)
    k, v = cache.k, cache.v
    for i, layer in enumerate(layers):
        (x, k, v), _ = llama.Block(config, jnp.float32).apply({"params": layer}, (x, k, v), i, positions_BT,
                                                            positions_BT)
    x = llama.RMSNorm(config.rms_norm_eps).apply({"params": params["final_norm"]}, x)
    head = embed if config.tie_embeddings else params["lm_head"]
    return quant.matmul_columns(x, head)
