r"""Target-only greedy decoding: specjax against transformers and llama.cpp, interleaved.

All load the same GGUF (transformers dequantizes it to float32; specjax keeps
the weight matrices block-quantized, the same values; llama.cpp reads the file's
own blocks). Same prompt, fixed token budget (EOS ignored on every side), batch
1 and batch 8. Each repetition runs every engine, in alternating order; medians
and the ratios are printed, with the fraction of the memory-bandwidth roofline:
weight bytes per token x tokens/s / copy bandwidth measured in this run.

--compare_head adds specjax with the embedding / LM head expanded to float32 (the
layout before the head was kept quantized), interleaved with the quantized one.
--peer llamacpp adds `llama-bench -p 0 -n N -d <prompt length> -r 1` per repetition
(generation only, timed by llama.cpp; binaries from scripts/build_llamacpp.sh).

    python experiments/bench_decode.py                      # SmolLM2, 128 tokens, 5 repetitions
    python experiments/bench_decode.py --reps 3 --batch8=false
    python experiments/bench_decode.py --batch8=false --transformers=false --compare_head \
        --peer llamacpp --llamacpp_dir ~/.cache/specjax/llama.cpp/bin
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags, logging

from experiments import _common as C
from experiments import _llamacpp

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset (a GGUF that transformers can load).")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per request.")
_REPS = flags.DEFINE_integer("reps", 5, "Interleaved repetitions (medians are reported).")
_BATCH8 = flags.DEFINE_boolean("batch8", True, "Also measure batch 8.")
_PROMPT = flags.DEFINE_string("prompt", "Write a Python function that returns the n-th prime number, "
                              "with a docstring and comments.", "User message (chat template applied).")
_PEER = flags.DEFINE_boolean("transformers", True, "Run transformers beside specjax.")
_PEERS = flags.DEFINE_multi_enum("peer", [], ["llamacpp"], "Further peers: llamacpp (llama-bench on the "
                                 "same GGUF at the prompt's depth).")
_LLAMACPP_DIR = flags.DEFINE_list("llamacpp_dir", [], "Directories of llama.cpp's binaries (scripts/"
                                  "build_llamacpp.sh); several: one row per build (e.g. with and without "
                                  "--amx), interleaved; empty: on PATH.")
_UBATCH = flags.DEFINE_integer("llamacpp_ubatch", 0, "llama-bench's -ub (physical batch) when > 0: 1 makes "
                               "a build whose multi-token kernels crash still decode at depth.")
_THREADS = flags.DEFINE_integer("llamacpp_threads", os.cpu_count() or 1, "llama.cpp's -t.")
_LAYERS = flags.DEFINE_multi_enum("layers", ["stacked"], ["stacked", "unrolled"], "specjax rows per layer "
                                  "layout (Engine(layers=...)); repeat the flag for several, interleaved.")
_MATMUL = flags.DEFINE_multi_enum("matmul", ["auto"], ["auto", "native", "q8", "xla"], "specjax rows per matmul "
                                  "path (Engine(matmul=...)); repeat the flag for several, interleaved.")
_COMPARE_HEAD = flags.DEFINE_boolean("compare_head", False, "Also run specjax with the embedding / LM head "
                                     "expanded to float32 (same values), interleaved.")


def bytes_per_token(params) -> int:
    """Weight bytes a decode step reads: with the native kernel's tile-major copy of the head
    (`head_tiles`), the table itself is only looked up (a few columns)."""
    from specjax.models import quant

    if "head_tiles" in params:
        params = {k: v for k, v in params.items() if k not in ("embed", "lm_head")}
    return quant.param_bytes(params)


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

    if _NEW.value <= 0 or _REPS.value <= 0:
        raise app.UsageError("--max_new_tokens and --reps must be positive")
    llamas = {}  # row name -> peer, one per llama.cpp build
    if "llamacpp" in _PEERS.value:  # checked before anything loads
        dirs = _LLAMACPP_DIR.value or [None]
        try:
            for i, d in enumerate(dirs):
                name = "llama.cpp" if len(dirs) == 1 else f"llama.cpp:{i + 1}"
                llamas[name] = _llamacpp.Peer(d, str(models.presets.resolve(_MODEL.value)), _NEW.value,
                                              _THREADS.value, ubatch=_UBATCH.value or None)
                llamas[name].check(["llama-bench"])
        except (_llamacpp.MissingBinaryError, models.presets.PresetError, ValueError) as e:
            raise app.UsageError(str(e)) from None
    m = models.load(_MODEL.value)
    ids = m.tokenizer.chat_prompt_ids(_PROMPT.value)
    batches = [1, 8] if _BATCH8.value else [1]
    variants = {}  # row name -> (model, layer layout, matmul); "specjax" is the first of each flag
    combos = [(lay, mm) for lay in dict.fromkeys(_LAYERS.value) for mm in dict.fromkeys(_MATMUL.value)]
    for i, (layers, matmul) in enumerate(combos):
        variants["specjax" if i == 0 else f"specjax ({layers} layers, {matmul} matmul)"] = (m, layers, matmul)
    if _COMPARE_HEAD.value:
        variants["specjax (float32 head)"] = (float_head(m), *combos[0])
    ours = {(name, b): specjax.Engine(v, max_new_tokens=_NEW.value, eos_ids=(), layers=layers, matmul=matmul)
            for name, (v, layers, matmul) in variants.items() for b in batches}
    for engine in ours.values():  # compile outside the timings
        engine.generate([ids] * engine_batch(engine, ours))

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

    weight_bytes = {name: bytes_per_token(ours[(name, 1)].params.target) for name in variants}
    if peer is not None:
        weight_bytes["transformers"] = peer_bytes
    for name, llama in llamas.items():  # the file's own bytes: what llama.cpp reads per token
        weight_bytes[name] = os.path.getsize(llama.model)
    bandwidth = copy_bandwidth_gbs()
    loads = [os.getloadavg()]
    engines = [*variants] + (["transformers"] if peer is not None else []) + list(llamas)
    times = {(who, b): [] for who in engines for b in batches if who not in llamas or b == 1}
    first_tokens = {}
    for rep in range(_REPS.value):
        order = engines if rep % 2 == 0 else engines[::-1]
        for b in batches:
            for who in order:
                if (who, b) not in times:
                    continue
                if who in llamas:  # timed by llama.cpp itself: generation at the prompt's depth
                    r = llamas[who].plain(len(ids))
                    n, dt = r.tokens, r.seconds
                else:
                    t = time.perf_counter()
                    if who == "transformers":
                        n = run_peer(b)
                    else:
                        out = ours[(who, b)].generate([ids] * b)
                        n = len(out.tokens[0])
                        first_tokens.setdefault(who, out.tokens[0])
                    dt = time.perf_counter() - t
                assert n == _NEW.value, (who, n)
                times[(who, b)].append(b * n / dt)
        loads.append(os.getloadavg())
    bandwidth = max(bandwidth, copy_bandwidth_gbs())

    print(f"machine: {C.machine()}" + (f"; torch threads {torch.get_num_threads()}" if peer is not None else ""))
    print("load averages (1, 5, 15 min) before and after each repetition: "
          + "; ".join("/".join(f"{x:.1f}" for x in la) for la in loads))
    print(f"model: {_MODEL.value}; prompt {len(ids)} tokens; {_NEW.value} new tokens; "
          f"{_REPS.value} interleaved repetitions; copy bandwidth {bandwidth:.1f} GB/s (read+write)")
    for name, llama in llamas.items():
        print(f"{name}: {llama.directory or 'binaries on PATH'}" + (f", -ub {llama.ubatch}" if llama.ubatch else ""))
    print("weight bytes per token: " + ", ".join(f"{who} {nb / 1e6:.0f} MB" for who, nb in weight_bytes.items())
          + " (specjax: block-quantized matrices; float32 head: embedding/head expanded; transformers: float32; "
          "llama.cpp: the GGUF file)")
    print()
    print("| engine | batch | tokens/s (median) | min | max | roofline fraction |")
    print("|---|---|---|---|---|---|")
    for (who, b), tps in times.items():
        med = statistics.median(tps)
        roof = weight_bytes[who] * med / b / (bandwidth * 1e9)  # weights are read once per step for the batch
        print(f"| {who} | {b} | {med:.1f} | {min(tps):.1f} | {max(tps):.1f} | {roof:.2f} |")
    for other in engines[1:]:
        for b in batches:
            if (other, b) in times:
                ratio = statistics.median(times[("specjax", b)]) / statistics.median(times[(other, b)])
                print(f"\nspecjax / {other} at batch {b}: {ratio:.2f}x")
    # the float32 paths must agree token for token; the q8 path (int8 activations) need not
    same = {who: toks for who, toks in first_tokens.items() if variants[who][2] != "q8"}
    if len(set(map(tuple, same.values()))) > 1:
        raise AssertionError(f"specjax variants disagree on the tokens: {same}")
    for who, toks in first_tokens.items():
        if variants[who][2] == "q8":
            ref = first_tokens["specjax"]
            diff = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
            print(f"{who}: " + ("the same tokens as specjax" if diff is None else
                                f"parts from specjax's tokens at token {diff} of {len(ref)} (int8 activations)"))
    print("\nfirst tokens:", repr(m.tokenizer.decode(first_tokens["specjax"][:24])))


def engine_batch(engine, ours) -> int:
    return next(b for (_, b), e in ours.items() if e is engine)


def float_head(m):
    """`m` with its block-quantized embedding / LM head expanded to float32 (the same values)."""
    import jax

    from specjax.models import quant

    params = dict(m.params)
    for name in ("embed", "lm_head"):
        if name in params and isinstance(params[name], quant.BlockQuant):
            params[name] = jax.block_until_ready(params[name].dequantize())
    return m.with_params(params)


if __name__ == "__main__":
    C.run_main(main)
