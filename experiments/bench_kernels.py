"""Pallas kernels vs their jnp references: correctness everywhere, speed on GPU/TPU.

    python experiments/bench_kernels.py                       # real shapes, default grid
    python experiments/bench_kernels.py --vocab=151936 --batch=1,16 --k=8 --dtype=bfloat16

For random logits of real shapes (V = 49152: SmolLM2; V = 151936: Qwen2.5) and
N = batch * (K + 1) rows, it reports the max abs difference of every gate
statistic between the kernel and the reference, and of the regret prefix
selection. On GPU/TPU it also times both (median of interleaved runs, each a
`lax.map` over --reps different logits arrays, per-array time reported) and
reports the bytes the kernel must move (the logits, read once) over its time,
against the device's peak memory bandwidth. On CPU the kernel runs in interpret
mode, so only correctness is checked and nothing is timed.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import flags

from experiments import _paths as P

import jax
import jax.numpy as jnp
import numpy as np

from specjax import pallas as sp
from specjax.pallas import _dispatch

FLAGS = flags.FLAGS
flags.DEFINE_list("vocab", ["49152", "151936"], "vocabulary sizes")
flags.DEFINE_list("batch", ["1", "4", "16"], "batch sizes; rows N = batch * (k + 1)")
flags.DEFINE_integer("k", 8, "draft length K")
flags.DEFINE_list("dtype", ["float32", "bfloat16"], "logit dtypes")
flags.DEFINE_integer("iters", 30, "timed iterations per implementation (accelerators)")
flags.DEFINE_integer("reps", 16, "different logits arrays processed per timed call (a lax.map), "
                     "so launch overhead is amortised and nothing is cached")
flags.DEFINE_float("max_gb", 4.0, "cap on the memory of the stacked timing inputs")
flags.DEFINE_integer("warmup", 3, "untimed iterations per implementation")
flags.DEFINE_integer("block_v", 0, "vocabulary block (0: the variant's default)")
flags.DEFINE_string("variant", "", "kernel variant: mosaic | triton (default: by backend)")
flags.DEFINE_integer("num_splits", 0, "vocabulary splits per row (0: default)")
flags.DEFINE_float("peak_gbps", 0.0, "device memory bandwidth in GB/s (0: from the table)")
flags.DEFINE_string("json_out", "", "also write the results as JSON lines to this file")
flags.DEFINE_integer("seed", 0, "random seed")

# Peak HBM bandwidth (GB/s) by device_kind substring, most specific first.
_PEAK_GBPS = [
    ("H200", 4800), ("H100", 3350), ("GH200", 4000), ("B200", 8000), ("A100", 2039),
    ("L40S", 864), ("L4", 300), ("A10", 600), ("V100", 900),
    ("TPU v6 lite", 1640), ("TPU v6e", 1640), ("TPU v5 lite", 819), ("TPU v5e", 819),
    ("TPU v5p", 2765), ("TPU v5", 2765), ("TPU v4", 1228), ("TPU v3", 900),
]


def peak_gbps(device) -> float | None:
    if FLAGS.peak_gbps:
        return FLAGS.peak_gbps
    kind = getattr(device, "device_kind", "")
    for key, gbps in _PEAK_GBPS:
        if key.lower() in kind.lower():
            return float(gbps)
    return None


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def interleaved_medians(fns, args, iters, warmup):
    for _ in range(warmup):
        for fn in fns:
            jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(iters):
        for t, fn in zip(times, fns):
            t.append(timed(fn, *args))
    return [statistics.median(t) for t in times]


def max_abs_diff(a, b) -> dict:
    out = {}
    for f in a._fields:
        x = np.asarray(getattr(a, f), np.float64)
        y = np.asarray(getattr(b, f), np.float64)
        same = (x == y) | (np.isnan(x) & np.isnan(y))  # equal infinities and NaNs count 0
        with np.errstate(invalid="ignore"):
            d = np.where(same, 0.0, np.abs(x - y))
        out[f] = float(np.nanmax(np.where(np.isnan(d), np.inf, d))) if d.size else 0.0
    return out


def bench_gate(V, batch, dtype, accel, interpret, rng):
    N = batch * (FLAGS.k + 1)
    key = jax.random.key(int(rng.integers(1 << 31)))
    # Gaussian logits with std 2.5 (normalized entropy about 0.7).
    x = (jax.random.normal(key, (N, V), jnp.float32) * 2.5).astype(dtype)
    tok = jnp.asarray(rng.integers(0, V, N), jnp.int32)
    kw = dict(interpret=interpret, variant=FLAGS.variant or None,
              block_v=FLAGS.block_v or None, num_splits=FLAGS.num_splits or None)
    kernel = jax.jit(lambda x, t: sp.gate_stats(x, t, impl="kernel", **kw))
    reference = jax.jit(lambda x, t: sp.gate_stats(x, t, impl="reference"))
    err = max_abs_diff(kernel(x, tok), reference(x, tok))
    row = dict(kernel="gate_stats", V=V, batch=batch, N=N, dtype=jnp.dtype(dtype).name,
               variant=_dispatch.resolve_variant(FLAGS.variant or None),
               max_abs_err=err)
    if accel:
        nbytes = N * V * jnp.dtype(dtype).itemsize + N * 4 + 7 * N * 4
        reps = max(1, min(FLAGS.reps, int(FLAGS.max_gb * 1e9 // nbytes)))
        xs = (jax.random.normal(jax.random.fold_in(key, 1), (reps, N, V), jnp.float32)
              * 2.5).astype(dtype)
        many = lambda f: jax.jit(lambda xs, t: jax.lax.map(lambda x: f(x, t), xs))
        t_k, t_r = interleaved_medians([many(kernel), many(reference)], (xs, tok),
                                       FLAGS.iters, FLAGS.warmup)
        t_k, t_r = t_k / reps, t_r / reps
        row.update(kernel_us=t_k * 1e6, reference_us=t_r * 1e6, bytes=nbytes, reps=reps,
                   kernel_gbps=nbytes / t_k / 1e9, reference_gbps=nbytes / t_r / 1e9,
                   speedup=t_r / t_k)
    return row


def bench_regret(batch, accel, interpret, rng):
    K = FLAGS.k
    mis = jnp.asarray(rng.random((batch, K)) < 0.3)
    r = jnp.asarray(rng.exponential(0.5, (batch, K)), jnp.float32)
    budget = jnp.asarray(rng.uniform(0, 4, batch), jnp.float32)
    k = jnp.asarray(rng.integers(1, K + 1, batch), jnp.int32)
    kernel = jax.jit(lambda m, r, b, k: sp.regret_prefix(m, r, b, num_draft=k, impl="kernel",
                                                         interpret=interpret))
    reference = jax.jit(lambda m, r, b, k: sp.regret_prefix(m, r, b, num_draft=k,
                                                            impl="reference"))
    a, b = kernel(mis, r, budget, k), reference(mis, r, budget, k)
    err = {f: float(np.max(np.abs(np.asarray(getattr(a, f), np.float64)
                                  - np.asarray(getattr(b, f), np.float64))))
           for f in a._fields}
    row = dict(kernel="regret_prefix", batch=batch, K=K, max_abs_err=err)
    if accel:
        t_k, t_r = interleaved_medians([kernel, reference], (mis, r, budget, k),
                                       FLAGS.iters, FLAGS.warmup)
        row.update(kernel_us=t_k * 1e6, reference_us=t_r * 1e6, speedup=t_r / t_k)
    return row


def fmt(row, peak) -> str:
    field, worst = max(row["max_abs_err"].items(), key=lambda kv: kv[1])
    if "V" in row:
        head = (f"gate_stats V={row['V']:>6} batch={row['batch']:>2} N={row['N']:>3} "
                f"{row['dtype']:>8} [{row['variant']}]  max|kernel-ref|={worst:.2e} ({field})")
    else:
        head = (f"regret_prefix batch={row['batch']:>2} K={row['K']}  "
                f"max|kernel-ref|={worst:.2e} ({field})")
    if "kernel_us" not in row:
        return head
    tail = (f"  kernel {row['kernel_us']:8.1f} us  reference {row['reference_us']:8.1f} us"
            f"  x{row['speedup']:.2f}")
    if "kernel_gbps" in row:
        tail += f"  {row['kernel_gbps']:7.1f} GB/s"
        if peak:
            tail += f" ({100 * row['kernel_gbps'] / peak:.0f}% of {peak:.0f})"
    return head + tail


def main(argv):
    P.check_output("json_out", FLAGS.json_out)  # before any work
    del argv
    accel = _dispatch.accelerator()
    interpret = accel is None
    device = jax.devices()[0]
    peak = peak_gbps(device) if accel else None
    print(f"backend={jax.default_backend()} device={getattr(device, 'device_kind', device)}")
    if accel:
        print(f"timing: median of {FLAGS.iters} interleaved runs (kernel, reference); "
              f"peak bandwidth {peak or 'unknown (pass --peak_gbps)'} GB/s")
    else:
        print("CPU: the kernels run in interpret mode; only correctness is checked, nothing is timed.")
    rng = np.random.default_rng(FLAGS.seed)
    rows = []
    for V in map(int, FLAGS.vocab):
        for batch in map(int, FLAGS.batch):
            for dtype in FLAGS.dtype:
                rows.append(bench_gate(V, batch, jnp.dtype(dtype), accel, interpret, rng))
                print(fmt(rows[-1], peak), flush=True)
    for batch in map(int, FLAGS.batch):
        rows.append(bench_regret(batch, accel, interpret, rng))
        print(fmt(rows[-1], peak), flush=True)
    if FLAGS.json_out:
        with P.atomic_open(FLAGS.json_out, "w") as f:
            for row in rows:
                f.write(json.dumps(dict(row, device=str(getattr(device, "device_kind", device)))) + "\n")


if __name__ == "__main__":
    P.run(main)
