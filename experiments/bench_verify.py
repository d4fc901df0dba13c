r"""Cost of one batched verify call, next to the target's verify forward, on this machine.

    python experiments/bench_verify.py                 # default grid: a cross around batch 1, K 8, V 49152
    python experiments/bench_verify.py --full          # batch {1,8,64} x K {8,16,32} x V {32768,49152,151936}
    python experiments/bench_verify.py --batch=1,8 --k=8 --vocab=49152 --methods=fly,asd --full
    python experiments/bench_verify.py --smoke         # tiny V, no model: checks that the binary runs

A verify call is a call of the rule object `specjax.verify.rule(method)` under
`jax.jit`, on random float32 logits [batch, K+1, V] and drafts that mostly match
their argmax (the rules are vectorised, so the values barely matter), with the
rule's state (ASD ledger, CSD memory) donated and carried from call to call as
the engine's loop carries it. `typical` runs at --temperature (T > 0; at T = 0 it
is greedy). The verify forward is `specjax.models.llama.forward_cached` of the
target (SmolLM2-135M by default) on [1, K+1] tokens with a cache of --cache_len
positions holding --context of them, cache donated, under `jax.jit`.

Every (shape, method) call and every forward is timed once per repetition, all
of them interleaved in one loop (the order rotates per repetition), so load
that drifts over the run hits each alike; each timing averages enough calls to
last --min_time seconds, and the table shows medians over --reps repetitions.
On CPU the statistics come from the jnp references (`specjax.pallas` dispatch);
on GPU/TPU from the Pallas kernels.

The overhead column divides by the batch-1 forward at the same K; for batch > 1
the target's forward of the whole batch is longer, so it overstates the
overhead there (--batched_forward also times the [batch, K+1] forward).

Published figures to compare with: the FLy gate costs 0.45-0.57 ms per round,
ASD 0.045-0.083 ms per token (both on their authors' GPUs).
"""

from __future__ import annotations

import math
import os
import statistics
import time

from absl import app, flags, logging

from experiments import _paths as P
from experiments._common import machine

FLAGS = flags.FLAGS
flags.DEFINE_list("batch", ["1", "8", "64"], "batch sizes")
flags.DEFINE_list("k", ["8", "16", "32"], "draft lengths K")
flags.DEFINE_list("vocab", ["32768", "49152", "151936"], "vocabulary sizes V")
flags.DEFINE_list("base", ["1", "8", "49152"], "batch, K, V of the default grid's centre: each of "
                  "--batch, --k, --vocab is varied on its own around it")
flags.DEFINE_bool("full", False, "time the full product --batch x --k x --vocab instead of the cross")
flags.DEFINE_list("methods", ["greedy", "fly", "asd", "csd", "typical"], "verification methods")
flags.DEFINE_float("temperature", 1.0, "temperature of `typical` (T > 0)")
flags.DEFINE_integer("reps", 9, "interleaved repetitions (medians are reported)")
flags.DEFINE_float("min_time", 0.1, "seconds each timing lasts at least (it averages that many calls)")
flags.DEFINE_string("model", "smollm2-135m-instruct", "target model (preset, GGUF or HF directory)")
flags.DEFINE_bool("forward", True, "time the target's verify forward (loads --model)")
flags.DEFINE_bool("batched_forward", False, "also time the forward on [batch, K+1] tokens for batch > 1")
flags.DEFINE_integer("cache_len", 512, "KV cache length of the forward")
flags.DEFINE_integer("context", 100, "positions already in the cache (the forward attends to them)")
flags.DEFINE_bool("smoke", False, "tiny settings without a model (V 256, batch 1 and 2, K 4, 2 reps)")
flags.DEFINE_integer("seed", 0, "random seed")

PUBLISHED = {"fly": (0.45, 0.57, "ms per round"), "asd": (0.045, 0.083, "ms per token")}


def load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def shapes() -> list[tuple[int, int, int]]:
    """(batch, K, V) to time: the full product, or the cross around --base."""
    bs, ks, vs = ([int(x) for x in FLAGS[name].value] for name in ("batch", "k", "vocab"))
    if min(bs + ks + vs) < 1:
        raise app.UsageError("--batch, --k and --vocab must be positive")
    if FLAGS.full:
        return [(b, k, v) for b in bs for k in ks for v in vs]
    if len(FLAGS.base) != 3:
        raise app.UsageError("--base takes batch,K,V")
    b0, k0, v0 = (int(x) for x in FLAGS.base)
    grid = [(b, k0, v0) for b in bs] + [(b0, k, v0) for k in ks] + [(b0, k0, v) for v in vs]
    return sorted(set(grid), key=grid.index)


class Timed:
    """A jitted call with its arguments (state carried and donated), timed on demand."""

    def __init__(self, fn, args, carry_index=None):
        self.fn, self.args, self.carry_index = fn, list(args), carry_index
        self.number = 1
        self.times: list[float] = []

    def call(self):
        out = self.fn(*self.args)
        if self.carry_index is not None:  # feed the donated state back in
            self.args[self.carry_index] = out[1]
        return out

    def calibrate(self, min_time: float):
        import jax

        jax.block_until_ready(self.call())  # compile
        t = time.perf_counter()
        jax.block_until_ready(self.call())
        self.number = max(1, math.ceil(min_time / max(time.perf_counter() - t, 1e-6)))

    def measure(self):
        import jax

        t = time.perf_counter()
        for _ in range(self.number):
            out = self.call()
        jax.block_until_ready(out)
        self.times.append((time.perf_counter() - t) / self.number * 1e3)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0 with fewer than 4 repetitions)."""
        if len(self.times) < 4:
            return 0.0
        q = statistics.quantiles(self.times, n=4)
        return (q[2] - q[0]) / self.median


def verify_call(method: str, B: int, K: int, V: int, rng) -> Timed:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import verify

    T = FLAGS.temperature if method == "typical" else 0.0
    rule = verify.rule(method)
    logits = rng.normal(0.0, 2.0, (B, K + 1, V)).astype(np.float32)
    drafts = logits[:, :K].argmax(-1).astype(np.int32)
    miss = rng.random((B, K)) < 0.25  # a quarter of the drafts miss their argmax
    drafts[miss] = rng.integers(0, V, int(miss.sum()))

    def run(state, d_BK, L_BRV, key):
        verdict, state, counts = rule(state, d_BK, L_BRV, key=key, temperature=T)
        return verdict, state, counts

    fn = jax.jit(run, donate_argnums=(0,))
    args = (rule.init_state(B), jnp.asarray(drafts), jnp.asarray(logits), jax.random.key(FLAGS.seed))
    return Timed(fn, args, carry_index=0)


def forward_call(model, B: int, K: int, rng) -> Timed:
    import jax
    import jax.numpy as jnp

    from specjax import models
    from specjax.models import llama

    if FLAGS.context + K + 1 > FLAGS.cache_len:
        raise app.UsageError(f"--context {FLAGS.context} + K + 1 does not fit --cache_len {FLAGS.cache_len}")
    cache = models.init_cache(model.config, B, FLAGS.cache_len)
    cache = cache._replace(lengths=jnp.full((B,), FLAGS.context, jnp.int32))
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (B, K + 1)), jnp.int32)

    def run(params, tokens_BT, cache):
        return llama.forward_cached(model.config, params, tokens_BT, cache)

    # forward_cached does not advance the lengths: every call scores the same positions.
    fn = jax.jit(run, donate_argnums=(2,))
    return Timed(fn, (model.params, tokens, cache), carry_index=2)


def fmt(ms: float | None) -> str:
    if ms is None:
        return "n/a"
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.smoke:
        for name, value in (("batch", ["1", "2"]), ("k", ["4"]), ("vocab", ["256"]), ("base", ["1", "4", "256"])):
            FLAGS[name].value = value
        FLAGS.reps, FLAGS.min_time, FLAGS.forward = min(FLAGS.reps, 2), 0.0, False
    if FLAGS.reps < 1:
        raise app.UsageError("--reps must be >= 1")
    import numpy as np

    from specjax import verify
    from specjax.pallas import _dispatch

    for method in FLAGS.methods:
        if method not in verify.METHODS:
            raise app.UsageError(f"unknown method {method!r}; expected one of {', '.join(verify.METHODS)}")
    load_before = load_average()
    rng = np.random.default_rng(FLAGS.seed)
    grid = shapes()

    calls: dict[tuple, Timed] = {}
    for B, K, V in grid:
        for method in FLAGS.methods:
            calls[("verify", B, K, V, method)] = verify_call(method, B, K, V, rng)
    model = None
    if FLAGS.forward:
        from specjax import models

        model = models.load(FLAGS.model)
        for K in sorted({K for _, K, _ in grid}):
            calls[("forward", 1, K)] = forward_call(model, 1, K, rng)
        if FLAGS.batched_forward:
            for B, K in sorted({(B, K) for B, K, _ in grid if B > 1}):
                calls[("forward", B, K)] = forward_call(model, B, K, rng)
    t0 = time.perf_counter()
    for timed in calls.values():
        timed.calibrate(FLAGS.min_time)
    compile_s = time.perf_counter() - t0

    order = list(calls.values())
    t0 = time.perf_counter()
    for rep in range(FLAGS.reps):
        shift = rep * len(order) // FLAGS.reps
        for timed in order[shift:] + order[:shift]:
            timed.measure()
    timed_s = time.perf_counter() - t0

    def forward_ms(B, K):
        timed = calls.get(("forward", B, K))
        return None if timed is None else timed.median

    impl = _dispatch.resolve_impl(None)
    print(f"machine: {machine()}")
    print(f"load average (1/5/15 min): {load_before} before, {load_average()} after "
          f"({os.cpu_count()} cores; a load above the core count means other processes shared them)")
    print(f"statistics: specjax.pallas {impl}"
          + (" (jnp reference: the CPU default)" if impl == "reference" else " (Pallas kernels)"))
    print(f"{FLAGS.reps} interleaved repetitions, each timing >= {FLAGS.min_time} s; "
          f"compile + calibration {compile_s:.0f} s, timing {timed_s:.0f} s")
    if model is not None:
        print(f"target forward: {FLAGS.model}, forward_cached on [1, K+1] tokens, cache {FLAGS.cache_len} "
              f"positions with {FLAGS.context} filled")
    print()
    head = "| batch | K | V | method | verify ms | ms per row | IQR/median | fwd [1,K+1] ms | verify / fwd |"
    if FLAGS.batched_forward and model is not None:
        head += " fwd [B,K+1] ms | verify / fwd [B] |"
    print(head)
    print("|" + "---|" * head.count(" |"))
    for B, K, V in grid:
        for method in FLAGS.methods:
            timed = calls[("verify", B, K, V, method)]
            ms, fwd = timed.median, forward_ms(1, K)
            name = f"typical (T={FLAGS.temperature:g})" if method == "typical" else method
            row = (f"| {B} | {K} | {V} | {name} | {fmt(ms)} | {fmt(ms / B)} | {timed.spread:.0%} | {fmt(fwd)} | "
                   + ("n/a" if fwd is None else f"{ms / fwd:.2%}") + " |")
            if FLAGS.batched_forward and model is not None:
                fwd_b = fwd if B == 1 else forward_ms(B, K)
                row += f" {fmt(fwd_b)} | " + ("n/a" if fwd_b is None else f"{ms / fwd_b:.2%}") + " |"
            print(row)

    print()
    print("Published (authors' GPUs): " + "; ".join(
        f"{m} {lo}-{hi} {unit}" for m, (lo, hi, unit) in PUBLISHED.items()) + ".")
    B0, K0, V0 = grid[0] if FLAGS.full else tuple(int(x) for x in FLAGS.base)
    for method, (lo, hi, unit) in PUBLISHED.items():
        timed = calls.get(("verify", B0, K0, V0, method))
        if timed is None:
            continue
        per_row = timed.median / B0
        if unit == "ms per round":
            print(f"  {method}: {fmt(per_row)} ms per round per row at batch {B0}, K {K0}, V {V0} "
                  f"(published {lo}-{hi})")
        else:  # a round emits between 1 and K+1 tokens per row
            print(f"  {method}: {fmt(per_row / (K0 + 1))}-{fmt(per_row)} ms per token at batch {B0}, K {K0}, "
                  f"V {V0} (K+1 down to 1 tokens per round; published {lo}-{hi})")
    fwd = forward_ms(1, K0)
    if fwd is not None and ("verify", 1, K0, V0, "fly") in calls:
        ratio = calls[("verify", 1, K0, V0, "fly")].median / fwd
        print(f"  goal: verify under 1% of the verify forward at batch 1, K {K0}, V {V0}: fly is at {ratio:.2%}")


if __name__ == "__main__":
    P.run(main)
