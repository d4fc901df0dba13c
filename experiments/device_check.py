r"""One short accelerator check: kernels and engine on GPU/TPU, with timings.

Weights are random with the real shapes where the checkpoint files are not on
the machine (SmolLM2-135M, Qwen2.5-Coder 1.5B/0.5B). Checks that speculative
greedy decoding equals target-only greedy on the device, and times target-only
and speculative decoding (medians of interleaved runs).

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

    lines = [f"device: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), jax {jax.__version__}"]

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
        target = random_model(Config(**cfg), seed=1)
        drafts = {"pld": "pld", "self:8": "self:8"}
        if draft_cfg is not None:
            drafts["draft-0.5b-shape"] = random_model(Config(**draft_cfg), seed=2)
        for batch_size in (1, 8):
            batch = prompts[:batch_size]
            engines = {"target-only": specjax.Engine(target, max_new_tokens=_NEW.value, eos_ids=())}
            for label, d in drafts.items():
                engines[f"exact/{label}"] = specjax.Engine(target, draft=d, k=8, max_new_tokens=_NEW.value, eos_ids=())
            engines["fly/pld"] = specjax.Engine(target, draft="pld", method="fly", k=8, max_new_tokens=_NEW.value,
                                                eos_ids=())
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
            log(f"\n{name}, batch {batch_size}, {_NEW.value} new tokens, K=8")
            log("| config | tokens/s | x target-only | tau |")
            log("|---|---|---|---|")
            for label, tps in results.items():
                med = statistics.median(tps)
                log(f"| {label} | {med:.1f} | {med / base:.2f} | {outs[label].stats['tau']:.2f} |")
    if _OUT.value:
        with P.atomic_open(_OUT.value, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    P.run(main)
