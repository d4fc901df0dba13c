r"""The native CPU kernel's two paths, matrix by matrix and for a whole forward, interleaved.

For each weight matrix of a model's first layer stack (and the LM head), the time of one
product with M rows of activations: M = 1 (a decode step) and M = K + 1 (a verify pass),
for the float32 path (`Engine(matmul="native")`: codes expanded to float32 in registers) and
the int8-activation path (`Engine(matmul="q8")`: activations rounded to int8 per block, VNNI
integer dot products). Each product runs 30 times inside one compiled scan (one layer of the
stack per step, the weights read where they lie, as the engine does), so JAX's dispatch cost
is not in the figure. Then the target's whole forward (`llama.forward_cached`) at T = 1 and
T = K + 1 positions with a cache of --cache_len, as the engine runs it (native attention on
both paths). Rounds alternate between the paths; medians.

    python experiments/bench_matmul.py                        # SmolLM2-135M, K = 8
    python experiments/bench_matmul.py --model qwen2.5-coder-1.5b-instruct --reps 3
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags

from experiments import _common as C

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf or HF directory.")
_K = flags.DEFINE_integer("k", 8, "Draft length: a verify pass scores K + 1 rows.")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 256, "Cache length S of the forward timings.")
_CONTEXT = flags.DEFINE_integer("context", 110, "Tokens already in the cache for the forward timings.")
_REPS = flags.DEFINE_integer("reps", 5, "Interleaved rounds (medians are reported).")
_CALLS = 30  # products per timed call (a scan), and layers per stack in the scan's index


def _best_ms(fn, calls: int, inner: int = 5) -> float:
    import jax

    times = []
    for _ in range(inner):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * min(times) / calls


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for f in (_K, _CACHE_LEN, _REPS):
        if f.value <= 0:
            raise app.UsageError(f"--{f.name} must be positive")
    if not 0 <= _CONTEXT.value < _CACHE_LEN.value - _K.value - 1:
        raise app.UsageError("--context must leave room for K + 1 positions below --cache_len")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import models, native
    from specjax.backend import Backend
    from specjax.models import llama
    from specjax.native import pack_params as _pack

    if not native.available():
        raise app.UsageError("the native kernel is not available here (see specjax.native)")
    m = models.load(_MODEL.value)
    c = m.config
    paths = {"float32 (native)": _pack(m.params, jnp.float32), "int8 activations (q8)": _pack(m.params, jnp.float32, True)}
    names = list(paths)
    rows_list = (1, _K.value + 1)
    rng = np.random.default_rng(0)

    def layer_call(w, x):
        n = jax.tree.leaves(w)[0].shape[0]

        def body(acc, i):
            return acc + native.dot(x + acc, w, i % n)[0, 0] * 1e-30, None
        return jax.jit(lambda: jax.lax.scan(body, jnp.float32(0), jnp.arange(_CALLS, dtype=jnp.int32))[0])

    def head_call(w, x):
        def body(acc, _):
            return acc + native.dot(x + acc, w)[0, 0] * 1e-30, None
        return jax.jit(lambda: jax.lax.scan(body, jnp.float32(0), None, length=_CALLS)[0])

    cases = {}  # (matrix, M) -> {path: fn}
    for M in rows_list:
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            ws = {p: params["layers"][name] for p, params in paths.items()}
            if not all(isinstance(w, (native.PackedQuant, native.Q8Tiles)) for w in ws.values()):
                continue
            K = int(np.prod(ws[next(iter(ws))].shape[:2 if name == "wo" else 1]))  # wo: [H, Dh, D]
            x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
            cases[(f"{name} {list(ws[next(iter(ws))].shape)}", M)] = {p: layer_call(w, x) for p, w in ws.items()}
        if all("head_tiles" in params for params in paths.values()):
            x = jnp.asarray(rng.standard_normal((M, c.hidden_size)).astype(np.float32))
            cases[(f"LM head [{c.hidden_size}, {c.vocab_size}]", M)] = {
                p: head_call(params["head_tiles"], x) for p, params in paths.items()}
    cache = llama.init_cache(c, 1, _CACHE_LEN.value, jnp.float32)._replace(
        lengths=jnp.array([_CONTEXT.value], jnp.int32))
    backend = Backend(matmul="native", kernels=native, native_attention=True)

    def run(params, tokens, cache):
        return llama.forward_cached(c, params, tokens, cache, backend=backend)[0]

    # as the engine runs them: native matmuls and native attention on both paths
    steps = {p: jax.jit(run) for p in paths}
    for T in rows_list:
        tokens = jnp.full((1, T), 5, jnp.int32)
        cases[(f"whole forward, T = {T}", T)] = {
            p: (lambda p=p, t=tokens: steps[p](paths[p], t, cache)) for p in paths}
    times = {key: {p: [] for p in fns} for key, fns in cases.items()}
    for fns in cases.values():  # compile outside the timings
        for fn in fns.values():
            jax.block_until_ready(fn())
    for r in range(_REPS.value):
        for key, fns in cases.items():
            order = list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]
            for p, fn in order:
                calls = 1 if key[0].startswith("whole") else _CALLS
                times[key][p].append(_best_ms(fn, calls))


    print(f"machine: {C.machine()}")
    print(f"model: {_MODEL.value}; K = {_K.value}; whole forward: cache {_CACHE_LEN.value}, position "
          f"{_CONTEXT.value}; {_REPS.value} interleaved rounds, medians\n")
    print(f"| product | rows | {' | '.join(n + ' (us)' for n in names)} | {names[0]} / {names[1]} |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for (what, M), per in times.items():
        med = {p: statistics.median(v) for p, v in per.items()}
        unit = 1.0 if what.startswith("whole") else 1e3  # ms for the forward, us for a product
        cells = " | ".join(f"{med[p] * unit:.0f}" if unit > 1 else f"{med[p]:.2f} ms" for p in names)
        print(f"| {what} | {M} | {cells} | {med[names[0]] / med[names[1]]:.2f}x |")


if __name__ == "__main__":
    C.run_main(main)
