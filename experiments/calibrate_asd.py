r"""ASD's published calibration of the regret budget and gate.

    python experiments/calibrate_asd.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --dataset humaneval --num_prompts 40 --k 8 \
        --output /tmp/asd_calibration.json
    python experiments/generate.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --method asd --asd_calibration /tmp/asd_calibration.json

Procedure (as published): exact speculative decoding with K drafts on the
calibration prompts; in each block whose first mismatch b satisfies b < K and
has a positive logit regret r_b = max L[b] - L[b][d_b], record r_b / ((K - b) / K),
its regret per "fraction" suffix weight. Budget and gate are both set to the
25th percentile of the recorded values (NumPy's default linear interpolation)
and the block cap to 1; the suffix weight they go with is "fraction".

The exact rounds are computed without the engine: the target decodes each prompt
greedily (exact speculative decoding emits the same tokens), then both models are
teacher-forced on prompt + continuation. Along that sequence a round whose
pending token sits at L drafts the draft's argmax at L, L+1, ... for as long as it
matches the target's (its prefix is then the target's tokens), so its first
mismatch b and the target logits there (hence r_b) come from the two forwards.
`--crosscheck` runs exact speculative decoding in the engine on the same prompts
and compares tokens and rounds per request with this reconstruction.

Writes JSON: budget, gate, block_cap, suffix, k, the percentile and a summary of
the values (and the values themselves); `--asd_calibration FILE` loads it in every
binary (explicit --budget/--gate/... flags win).
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import app, flags, logging


from experiments import _common as C, _paths, _rounds as R
C.define_calibration_source_flags(num_prompts=40, max_new_tokens=128)
for _module in C.FLAG_MODULES:  # --help lists the shared flags
    flags.adopt_module_key_flags(_module)
_K = flags.DEFINE_integer("k", 8, "Draft tokens per block K (calibrate at the K you will run).")
_PERCENTILE = flags.DEFINE_float("percentile", 25.0, "Percentile of the values for budget and gate "
                                 "(25 as published).")
_OUTPUT = flags.DEFINE_string("output", None, "JSON file to write. Required.")
_CROSSCHECK = flags.DEFINE_boolean("crosscheck", False, "Also run exact speculative decoding in the engine "
                                   "and compare its rounds with the reconstruction.")
flags.mark_flags_as_required(["output"])
FLAGS = flags.FLAGS


def main(argv):
    C.check_output("output", _OUTPUT.value); C.check_output("cache_dir", FLAGS.cache_dir, dir=True)  # before any work
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    _paths.set_status(lambda: R.interrupt_status(f"the calibration {_OUTPUT.value}", FLAGS.cache_dir))
    C.validate_calibration_source_flags()
    if _K.value <= 0:
        raise app.UsageError(f"--k must be positive, got {_K.value}")
    if not 0 <= _PERCENTILE.value <= 100:
        raise app.UsageError(f"--percentile must be in [0, 100], got {_PERCENTILE.value}")
    logging.set_verbosity(logging.WARNING)
    start = time.perf_counter()
    dataset = None if FLAGS.prompts_file else FLAGS.dataset
    texts = C.read_prompts(None, FLAGS.prompts_file, dataset, FLAGS.num_prompts, FLAGS.prompt_offset)
    if not texts:
        raise app.UsageError("no calibration prompts (check --prompt_offset / --num_prompts)")
    target = C.load_model(FLAGS.model)
    draft = C.draft_model(FLAGS.draft, target)
    K = _K.value
    ids = C.encode(target.tokenizer, texts, FLAGS.chat)
    forced = R.calibration_data(target, draft, ids, target_spec=FLAGS.model, draft_spec=FLAGS.draft,
                                max_new_tokens=FLAGS.max_new_tokens, batch_size=FLAGS.batch_size,
                                bucket=FLAGS.bucket, k=_K.value, cache_dir=FLAGS.cache_dir)
    values, rounds_per_request, cut, mismatch_rounds, zero_regret = [], [], 0, 0, 0
    for (seq, t_Q, d_Q, regret_Q), p in zip(forced, ids):
        end = R.consistent_end(t_Q, seq, len(p))
        cut += end < len(seq) - 1
        v, rounds = R.asd_block_values(t_Q, d_Q, regret_Q, len(p), end, K)
        values += v
        rounds_per_request.append(len(rounds) if end == len(seq) - 1 else None)
        mismatch_rounds += sum(r.mismatch for r in rounds)
        zero_regret += sum(r.mismatch for r in rounds) - len(v)
    if not values:
        raise app.UsageError("no block had a mismatch with positive regret: nothing to calibrate on "
                             "(more prompts or a longer --max_new_tokens)")
    v = np.asarray(values, np.float64)
    value = float(np.percentile(v, _PERCENTILE.value))  # linear interpolation, NumPy's default
    result = {
        "budget": value, "gate": value, "block_cap": 1, "suffix": "fraction", "k": K,
        "percentile": _PERCENTILE.value, "num_values": int(len(v)),
        "summary": {"min": float(v.min()), "p25": float(np.percentile(v, 25)), "median": float(np.median(v)),
                    "mean": float(v.mean()), "max": float(v.max())},
        "rounds": int(sum(r for r in rounds_per_request if r is not None)),
        "mismatch_rounds": int(mismatch_rounds), "zero_regret_mismatches": int(zero_regret),
        "sequences_cut_at_a_near_tie": int(cut), "target": FLAGS.model, "draft": FLAGS.draft,
        "dataset": dataset, "prompts_file": FLAGS.prompts_file, "prompt_offset": FLAGS.prompt_offset,
        "num_prompts": len(texts), "chat": FLAGS.chat, "max_new_tokens": FLAGS.max_new_tokens,
        "generated_tokens": int(sum(len(f.seq) - len(p) for f, p in zip(forced, ids))),
        "procedure": "exact speculative decoding; per block, first mismatch b < K with r_b > 0 gives "
                     "r_b / ((K - b) / K); budget = gate = percentile (linear); block_cap = 1; suffix fraction",
        "seconds": time.perf_counter() - start, "machine": C.machine(),
    }
    R.stage("computing the percentile")
    if _CROSSCHECK.value:
        R.stage("running the crosscheck (--crosscheck) in the engine")
        result["crosscheck"] = crosscheck(target, ids, [f.seq.tolist() for f in forced], rounds_per_request)
    result["values"] = [float(x) for x in v]
    with C.atomic_open(_OUTPUT.value, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"ASD calibration (k={K}): {len(v)} values from {mismatch_rounds} mismatch blocks in "
          f"{result['rounds']} rounds ({len(texts)} prompts, {result['generated_tokens']} tokens)")
    print(f"  values: min {v.min():.4g}, p25 {result['summary']['p25']:.4g}, median {np.median(v):.4g}, "
          f"max {v.max():.4g}")
    print(f"  budget = gate = {value:.6g} (percentile {_PERCENTILE.value:g}), block_cap = 1, suffix = fraction")
    if "crosscheck" in result:
        c = result["crosscheck"]
        print(f"  crosscheck with the engine: tokens identical {c['tokens_identical']}/{c['requests']}, "
              f"rounds identical {c['rounds_identical']}/{c['compared']}")
    print(f"  wrote {_OUTPUT.value}")


def crosscheck(target, ids, seqs, rounds_per_request) -> dict:
    # fixed K: the reconstruction's rounds verify every draft, as the published procedure does
    engine = C.make_engine(target, C.resolve_draft(FLAGS.draft, FLAGS.model), "greedy", _K.value,
                           FLAGS.max_new_tokens, adaptive=False)
    out = C.run(engine, ids, 1, label="crosscheck: ", progress=True)
    same_tokens = sum(list(p) + t == s for p, t, s in zip(ids, out.tokens, seqs))
    pairs = [(a, b) for a, b in zip(rounds_per_request, out.stats["rounds_per_request"]) if a is not None]
    return {"requests": len(ids), "tokens_identical": int(same_tokens), "compared": len(pairs),
            "rounds_identical": int(sum(a == b for a, b in pairs)),
            "rounds_reconstructed": [a for a, _ in pairs], "rounds_engine": [b for _, b in pairs]}


if __name__ == "__main__":
    C.run_main(main)
