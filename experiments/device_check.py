r"""One short accelerator check: kernels and engine on GPU/TPU, with timings.

Weights are random with the real shapes where the checkpoint files are not on
the machine (SmolLM2-135M, Qwen2.5-Coder 1.5B/0.5B), in --dtype (bf16 by default,
as served). Checks that speculative greedy decoding equals target-only greedy on
the device, and times target-only and speculative decoding (medians of
interleaved runs): fixed K = 8 beside the adaptive loop (the Engine's default,
K = 8 its maximum), with the widths it chose and the cost table it measured on
the device (verify seconds per width, in target steps).

    python experiments/device_check.py --out /tmp/device.md
"""

from __future__ import annotations

import statistics
import time

from absl import flags

from experiments import _paths as P

_OUT = flags.DEFINE_string("out", "", "Also write the report here.")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per request.")
_REPS = flags.DEFINE_integer("reps", 3, "Interleaved repetitions.")
_QWEN = flags.DEFINE_boolean("qwen", True, "Also the Qwen 1.5B/0.5B shapes.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "The models' dtype.")

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, rope_theta=1e5, tie_embeddings=True)
QWEN15 = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
              num_kv_heads=2, head_dim=128, rope_theta=1e6, qkv_bias=True, architecture="qwen2")
QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
              num_kv_heads=2, head_dim=64, rope_theta=1e6, qkv_bias=True, tie_embeddings=True, architecture="qwen2")


def main(argv):
    P.check_output("out", _OUT.value)  # before any work
    del argv
    import jax
    import numpy as np

    import specjax
    from specjax.models import Config, random_model

    import jax.numpy as jnp

    dtype = jnp.dtype(_DTYPE.value)
    lines = [f"device: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), jax {jax.__version__}, "
             f"{_DTYPE.value} weights"]

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    rng = np.random.default_rng(0)
    # repetitive prompts so that prompt lookup finds matches even with random weights
    prompts = [list(rng.integers(0, 1000, 24)) * 3 for _ in range(8)]

    def timed(engine, batch):
        t = time.perf_counter()
        out = engine.generate(batch)
        return sum(len(x) for x in out.tokens) / (time.perf_counter() - t), out

    for name, cfg, draft_cfg in [("smollm2-135m (random weights)", SMOLLM2, None),
                                 ("qwen2.5-coder-1.5b (random weights)", QWEN15, QWEN05)][: 2 if _QWEN.value else 1]:
        target = random_model(Config(**cfg), seed=1, dtype=dtype)
        drafts = {"pld": "pld", "self:8": "self:8"}
        if draft_cfg is not None:
            drafts["draft-0.5b-shape"] = random_model(Config(**draft_cfg), seed=2, dtype=dtype)
        for batch_size in (1, 8):
            batch = prompts[:batch_size]
            settings = dict(k=8, max_new_tokens=_NEW.value, eos_ids=())
            engines = {"target-only": specjax.Engine(target, max_new_tokens=_NEW.value, eos_ids=())}
            for label, d in drafts.items():
                engines[f"exact/{label}"] = specjax.Engine(target, draft=d, **settings, adaptive=False)
                engines[f"exact/{label}/adaptive"] = specjax.Engine(target, draft=d, **settings)
            engines["fly/pld"] = specjax.Engine(target, draft="pld", method="fly", **settings, adaptive=False)
            engines["fly/pld/adaptive"] = specjax.Engine(target, draft="pld", method="fly", **settings)
            results = {k: [] for k in engines}
            outs = {}
            for label, e in engines.items():  # compile
                outs[label] = e.generate(batch)
            base_tokens = outs["target-only"].tokens
            for label, out in outs.items():
                if label.startswith("exact"):
                    same = out.tokens == base_tokens
                    log(f"{name} batch {batch_size}: {label} tokens equal target-only: {same}")
            for _ in range(_REPS.value):
                for label, e in engines.items():
                    results[label].append(timed(e, batch)[0])
            base = statistics.median(results["target-only"])
            log(f"\n{name}, batch {batch_size}, {_NEW.value} new tokens, K=8 (fixed, or the adaptive loop's maximum)")
            log("| config | tokens/s | x target-only | tau | widths chosen (width: rounds) |")
            log("|---|---|---|---|---|")
            for label, tps in results.items():
                med = statistics.median(tps)
                widths = outs[label].stats.get("widths")
                chosen = ", ".join(f"{w}: {n}" for w, n in enumerate(widths or []) if n) or "-"
                log(f"| {label} | {med:.1f} | {med / base:.2f} | {outs[label].stats['tau']:.2f} | {chosen} |")
            for label, e in engines.items():
                table = e.cost_table(batch_size) if label.endswith("/adaptive") else None
                if table is not None:
                    steps, draft = table.in_steps()
                    log(f"cost table ({label}, measured here): verify in target steps "
                        + " ".join(f"w{i + 1}={x:.2f}" for i, x in enumerate(steps))
                        + f"; draft step {draft:.2f}; width 1 = {table.verify_s[0] * 1e3:.2f} ms")
    if _OUT.value:
        with P.atomic_open(_OUT.value, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    P.run(main)
