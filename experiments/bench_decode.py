r"""Target-only greedy decoding: specjax against transformers' generate, interleaved.

Both load the same GGUF (transformers dequantizes it to float32; specjax keeps
the layer weights block-quantized, the same values). Same prompt, fixed token
budget (EOS ignored on both sides), batch 1 and batch 8. Each repetition runs
transformers, then specjax, in alternating order; medians and the ratio are
printed, with the fraction of the memory-bandwidth roofline:
weight bytes per token x tokens/s / copy bandwidth measured in this run.

    python experiments/bench_decode.py                      # SmolLM2, 128 tokens, 5 repetitions
    python experiments/bench_decode.py --reps 3 --batch8=false
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags, logging

try:  # imported as experiments.bench_decode (tests) or run as a script (experiments/ on sys.path)
    from experiments import _common as C
except ImportError:
    import _common as C

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset (a GGUF that transformers can load).")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per request.")
_REPS = flags.DEFINE_integer("reps", 5, "Interleaved repetitions (medians are reported).")
_BATCH8 = flags.DEFINE_boolean("batch8", True, "Also measure batch 8.")
_PROMPT = flags.DEFINE_string("prompt", "Write a Python function that returns the n-th prime number, "
                              "with a docstring and comments.", "User message (chat template applied).")
_PEER = flags.DEFINE_boolean("transformers", True, "Run transformers beside specjax.")


def copy_bandwidth_gbs(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """(read + write) bytes per second of a large numpy copy."""
    import numpy as np

    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times) / 1e9


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import specjax
    from specjax import models
    from specjax.models import quant

    if _NEW.value <= 0 or _REPS.value <= 0:
        raise app.UsageError("--max_new_tokens and --reps must be positive")
    m = models.load(_MODEL.value)
    ids = m.tokenizer.chat_prompt_ids(_PROMPT.value)
    batches = [1, 8] if _BATCH8.value else [1]
    ours = {b: specjax.Engine(m, max_new_tokens=_NEW.value, eos_ids=()) for b in batches}
    for b in batches:  # compile outside the timings
        ours[b].generate([ids] * b)

    peer = None
    if _PEER.value:
        import torch
        import transformers

        path = models.presets.resolve(_MODEL.value)
        peer = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
        peer_bytes = sum(p.numel() * p.element_size() for p in peer.parameters())

        def run_peer(b):
            with torch.inference_mode():
                batch = torch.tensor([ids] * b)
                out = peer.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=_NEW.value,
                                    min_new_tokens=_NEW.value, do_sample=False,
                                    pad_token_id=m.tokenizer.eos_token_id)
            return out.shape[1] - len(ids)

        run_peer(1)  # warm-up

    ours_bytes = quant.param_bytes(m.params)
    bandwidth = copy_bandwidth_gbs()
    times = {("specjax", b): [] for b in batches}
    if peer is not None:
        times.update({("transformers", b): [] for b in batches})
    first_tokens = None
    for rep in range(_REPS.value):
        order = ["transformers", "specjax"] if rep % 2 == 0 else ["specjax", "transformers"]
        for b in batches:
            for who in order:
                if who == "transformers" and peer is None:
                    continue
                t = time.perf_counter()
                if who == "specjax":
                    out = ours[b].generate([ids] * b)
                    n = len(out.tokens[0])
                    first_tokens = first_tokens or out.tokens[0]
                else:
                    n = run_peer(b)
                dt = time.perf_counter() - t
                assert n == _NEW.value, (who, n)
                times[(who, b)].append(b * n / dt)
    bandwidth = max(bandwidth, copy_bandwidth_gbs())

    print(f"machine: {C.machine()}" + (f"; torch threads {torch.get_num_threads()}" if peer is not None else ""))
    print(f"model: {_MODEL.value}; prompt {len(ids)} tokens; {_NEW.value} new tokens; "
          f"{_REPS.value} interleaved repetitions; copy bandwidth {bandwidth:.1f} GB/s (read+write)")
    print(f"weight bytes per token: specjax {ours_bytes / 1e6:.0f} MB (block-quantized layers), "
          + (f"transformers {peer_bytes / 1e6:.0f} MB (float32)" if peer is not None else ""))
    print()
    print("| engine | batch | tokens/s (median) | min | max | roofline fraction |")
    print("|---|---|---|---|---|---|")
    for (who, b), tps in times.items():
        med = statistics.median(tps)
        weight_bytes = ours_bytes if who == "specjax" else peer_bytes
        roof = weight_bytes * med / b / (bandwidth * 1e9)  # weights are read once per step for the batch
        print(f"| {who} | {b} | {med:.1f} | {min(tps):.1f} | {max(tps):.1f} | {roof:.2f} |")
    if peer is not None:
        for b in batches:
            ratio = statistics.median(times[("specjax", b)]) / statistics.median(times[("transformers", b)])
            print(f"\nspeedup over transformers at batch {b}: {ratio:.2f}x")
    print("\nfirst tokens:", repr(m.tokenizer.decode(first_tokens[:24])))


if __name__ == "__main__":
    C.run_main(main)
