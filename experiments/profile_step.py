r"""Where one decode step's time goes: XLA's own per-operation timings, and the weight paths side by side.

One target-only step (B = 1, T = 1, a cache of --cache_len with --context tokens in it) is run
under `jax.profiler`; the operations of the compiled program are summed by name from the trace
and the largest are printed with their share of the step. Then the same step is timed for
several ways of holding the weights, interleaved (the median of --reps calls each), with the
logits compared bit for bit against the model as loaded:

    stacked, as loaded    layers stacked on axis 0 and scanned (`llama.forward_cached`), block-
                          quantized matrices kept as codes (what the engine runs)
    stacked, float32      the same scan over float32 matrices
    unrolled, float32     one float32 array per layer, a loop of layers (`llama.unstack_layers`,
                          what Engine(layers="unrolled") runs)

and, per [D, F] matrix of the model, the rate at which XLA:CPU turns stored weights into a
matrix-vector product (weights per second): a float32 dot, and block codes dequantized and dotted.

    python experiments/profile_step.py                          # SmolLM2-135M
    python experiments/profile_step.py --model qwen2.5-coder-0.5b-instruct --top 15
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags

from experiments import _common as C
from experiments._profile import profile_ops

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf or HF directory.")
_CONTEXT = flags.DEFINE_integer("context", 50, "Tokens already in the cache (the step's position).")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 256, "Cache length S.")
_REPS = flags.DEFINE_integer("reps", 30, "Timed calls per variant (interleaved; medians are reported).")
_TOP = flags.DEFINE_integer("top", 12, "Operations listed from the profile.")
_VARIANTS = flags.DEFINE_boolean("variants", True, "Also time the float32 / unrolled variants.")


def _median_ms(fn, args, reps):
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for f in (_CONTEXT, _CACHE_LEN, _REPS, _TOP):
        if f.value <= 0:
            raise app.UsageError(f"--{f.name} must be positive")
    if _CONTEXT.value >= _CACHE_LEN.value:
        raise app.UsageError("--context must be below --cache_len")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import models
    from specjax.models import llama, quant

    m = models.load(_MODEL.value)
    c = m.config
    is_q = lambda x: isinstance(x, quant.BlockQuant)  # noqa: E731
    cache = llama.init_cache(c, 1, _CACHE_LEN.value, jnp.float32)._replace(
        lengths=jnp.array([_CONTEXT.value], jnp.int32))
    tokens = jnp.array([[5]], jnp.int32)
    step = jax.jit(lambda p, t, cache: llama.forward_cached(c, p, t, cache)[0])

    print(f"machine: {C.machine()}")
    print(f"model: {_MODEL.value}; one decode step, B=1, T=1, position {_CONTEXT.value}, cache {_CACHE_LEN.value}; "
          f"weight bytes {quant.param_bytes(m.params) / 1e6:.0f} MB")
    ops = profile_ops(step, (m.params, tokens, cache))
    # control flow (a while loop's own span holds its body's operations) is not summed
    leaf_ms = sum(ms for name, ms, _ in ops if not name.startswith(("while", "conditional", "call")))
    print(f"\nprofile of the engine's step ({leaf_ms:.1f} ms of operations per step under the profiler; "
          f"{_median_ms(step, (m.params, tokens, cache), _REPS.value):.1f} ms without it):\n")
    print("| operation | ms per step | calls per step | share of the operations |")
    print("|---|---|---|---|")
    for name, ms, n in ops[:_TOP.value]:
        share = "(holds others)" if name.startswith(("while", "conditional", "call")) else f"{ms / leaf_ms:.0%}"
        print(f"| {name} | {ms:.2f} | {n:g} | {share} |")

    if _VARIANTS.value:
        f32 = lambda x: x.dequantize() if is_q(x) else x  # noqa: E731
        float_params = jax.block_until_ready(jax.tree.map(f32, m.params, is_leaf=is_q))
        variants = {"stacked, as loaded": (step, (m.params, tokens, cache)),
                    "stacked, float32": (step, (float_params, tokens, cache)),
                    "unrolled, float32": (step, (llama.unstack_layers(float_params), tokens, cache))}
        ref = np.asarray(step(m.params, tokens, cache))
        times = {name: [] for name in variants}
        for _ in range(3):  # interleaved rounds
            for name, (fn, args) in variants.items():
                times[name].append(_median_ms(fn, args, _REPS.value))
        print("\n| weights | ms per step (median) | tokens/s | logits equal to the engine's |")
        print("|---|---|---|---|")
        base = statistics.median(times["stacked, as loaded"])
        for name, (fn, args) in variants.items():
            ms = statistics.median(times[name])
            same = bool(np.array_equal(np.asarray(fn(*args)), ref))
            print(f"| {name} | {ms:.1f} ({base / ms:.2f}x) | {1e3 / ms:.1f} | {same} |")

        w = m.params["layers"]["w_gate"]
        x = jnp.ones((1, c.hidden_size), jnp.float32)
        dense = jax.jit(lambda x, w: x @ w)
        w_f = float_params["layers"]["w_gate"][0]
        rates = {"float32 dot": _median_ms(dense, (x, w_f), 200)}
        if is_q(w):
            one = quant.BlockQuant(w.codes[0], w.scale[0], None if w.offset is None else w.offset[0], w.shape)
            deq = jax.jit(lambda x, q: x @ q.dequantize())
            rates["block codes, dequantized then dot"] = _median_ms(deq, (x, one), 200)
        n = int(np.prod(w_f.shape))
        print(f"\none [{w_f.shape[0]}, {w_f.shape[1]}] matrix-vector product (w_gate of layer 0):")
        for name, ms in rates.items():
            print(f"  {name}: {ms * 1e3:.0f} us = {n / ms / 1e6:.2f} G weights/s")


if __name__ == "__main__":
    C.run_main(main)
