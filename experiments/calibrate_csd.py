r"""Builds CSD's correction memory offline from unlabeled prompts, and saves it with orbax.

    python experiments/calibrate_csd.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --dataset humaneval --num_prompts 40 \
        --output /tmp/csd_memory --eval_prompts 10
    python experiments/generate.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --method csd --csd_memory /tmp/csd_memory

Procedure: the target decodes every prompt greedily (natural EOS end); then both
models are teacher-forced on each prompt + continuation (`Model.logits`, one
forward each). At every position the draft would draft at, the draft's argmax d
and the target's argmax t are compared, and each disagreement counts one for the
pair (d, t). `--positions rounds` counts only what exact speculative decoding with
K drafts examines: the first mismatch of each round. A draft of another vocabulary (its
proposals translated into the target's ids, docs/cross_vocab.md) cannot be teacher-forced on the
target's ids: its exact rounds at --k are run instead, and "every position" is every position
those rounds drafted. Only the token pairs and
their counts are saved (orbax: pairs int32[P, 2], counts int32[P], capacity), so
the memory does not depend on the hash table's layout; `--csd_memory DIR` loads it
in every binary. More distinct pairs than --capacity keep the most frequent ones.

`--eval_prompts N` then runs method csd on the next N prompts of the dataset with
an empty and with the calibrated memory (and exact speculative decoding, whose
output is the target's greedy output) and prints tau, loose share and divergence.
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
_POSITIONS = flags.DEFINE_enum("positions", "all", ["all", "rounds"],
                               "all: every drafted position; rounds: first mismatch of each exact round (--k).")
_K = flags.DEFINE_integer("k", 8, "Draft length for --positions rounds and for --eval_prompts.")
_CAPACITY = flags.DEFINE_integer("capacity", 1 << 16, "Memory capacity (distinct pairs).")
_OUTPUT = flags.DEFINE_string("output", None, "Directory to save the memory in (orbax). Required.")
_EVAL = flags.DEFINE_integer("eval_prompts", 0, "Held-out prompts to compare empty vs calibrated memory on.")
_MIN_COUNT = flags.DEFINE_integer("min_count", None, "csd min_count for --eval_prompts (unset: rule default).")
_TAU = flags.DEFINE_float("tau", None, "csd tau for --eval_prompts (unset: rule default).")
flags.mark_flags_as_required(["output"])
FLAGS = flags.FLAGS


def _validate():
    C.validate_calibration_source_flags()
    for name in ("k", "capacity"):
        if FLAGS[name].value <= 0:
            raise app.UsageError(f"--{name} must be positive, got {FLAGS[name].value}")
    if _EVAL.value < 0:
        raise app.UsageError(f"--eval_prompts must be >= 0, got {_EVAL.value}")


def count_pairs(forced: list[R.Forced], prompt_lens, positions: str, k: int):
    """(pairs int32[P, 2], counts int32[P], summary) of the draft/target disagreements."""
    found, compared, truncated = [], 0, 0
    for (seq, t_Q, d_Q, _), prompt_len in zip(forced, prompt_lens):
        end = R.consistent_end(t_Q, seq, prompt_len)
        truncated += end < len(seq) - 1
        if positions == "all":
            q = np.arange(prompt_len, end)
            q = q[d_Q[q] >= 0]  # -1: not drafted (a draft of another vocabulary, `R.RoundDriver`)
            compared += len(q)
        else:
            rounds = R.exact_rounds(t_Q, d_Q, prompt_len, end, k)
            q = np.asarray([r.L + r.b for r in rounds if r.mismatch], np.int64)
            compared += sum(r.b + r.mismatch for r in rounds)  # drafts the rounds examined
        q = q[d_Q[q] != t_Q[q]]
        found.append(np.stack([d_Q[q], t_Q[q]], axis=1) if len(q) else np.zeros((0, 2), np.int64))
    all_pairs = np.concatenate(found) if found else np.zeros((0, 2), np.int64)
    if len(all_pairs):
        pairs, counts = np.unique(all_pairs, axis=0, return_counts=True)
    else:
        pairs, counts = np.zeros((0, 2), np.int64), np.zeros((0,), np.int64)
    summary = {"positions_compared": int(compared), "mismatches": int(len(all_pairs)),
               "distinct_pairs": int(len(pairs)), "sequences_cut_at_a_near_tie": int(truncated)}
    return pairs.astype(np.int32), counts.astype(np.int32), summary


def main(argv):
    C.check_output("output", _OUTPUT.value, dir=True); C.check_output("cache_dir", FLAGS.cache_dir, dir=True)  # before any work
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    _paths.set_status(lambda: R.interrupt_status(f"the memory {_OUTPUT.value}", FLAGS.cache_dir))
    _validate()
    logging.set_verbosity(logging.WARNING)
    start = time.perf_counter()
    dataset = None if FLAGS.prompts_file else FLAGS.dataset
    texts = C.read_prompts(None, FLAGS.prompts_file, dataset, None)
    calib = texts[FLAGS.prompt_offset: FLAGS.prompt_offset + FLAGS.num_prompts]
    held_out = texts[FLAGS.prompt_offset + FLAGS.num_prompts: FLAGS.prompt_offset + FLAGS.num_prompts + _EVAL.value]
    if not calib:
        raise app.UsageError("no calibration prompts (check --prompt_offset / --num_prompts)")
    if len(held_out) < _EVAL.value:
        raise app.UsageError(f"--eval_prompts {_EVAL.value}: only {len(held_out)} prompts left after the "
                             "calibration ones")
    target = C.load_model(FLAGS.model)
    draft = C.draft_model(FLAGS.draft, target)
    tok = target.tokenizer
    ids = C.encode(tok, calib, FLAGS.chat)
    forced = R.calibration_data(target, draft, ids, target_spec=FLAGS.model, draft_spec=FLAGS.draft,
                                max_new_tokens=FLAGS.max_new_tokens, batch_size=FLAGS.batch_size,
                                bucket=FLAGS.bucket, k=_K.value, cache_dir=FLAGS.cache_dir)
    R.stage("counting the pairs")
    pairs, counts, summary = count_pairs(forced, [len(p) for p in ids], _POSITIONS.value, _K.value)
    if len(pairs) > _CAPACITY.value:
        keep = np.argsort(-counts, kind="stable")[: _CAPACITY.value]
        C.log(f"{len(pairs)} distinct pairs > capacity {_CAPACITY.value}: keeping the most frequent")
        pairs, counts = pairs[keep], counts[keep]
    order = np.argsort(-counts, kind="stable")
    top = [{"draft": tok.decode([int(pairs[i, 0])]), "target": tok.decode([int(pairs[i, 1])]),
            "draft_id": int(pairs[i, 0]), "target_id": int(pairs[i, 1]), "count": int(counts[i])}
           for i in order[:20]]
    meta = {"target": FLAGS.model, "draft": FLAGS.draft, "vocab_size": target.config.vocab_size,
            "dataset": dataset, "prompts_file": FLAGS.prompts_file, "prompt_offset": FLAGS.prompt_offset,
            "num_prompts": len(calib), "chat": FLAGS.chat, "max_new_tokens": FLAGS.max_new_tokens,
            "generated_tokens": int(sum(len(f.seq) - len(p) for f, p in zip(forced, ids))),
            "positions": _POSITIONS.value, "k": _K.value, "capacity": _CAPACITY.value, **summary,
            "stored_pairs": int(len(pairs)), "pairs_above_default_min_count": int((counts > 6).sum()),
            "top_pairs": top, "seconds": time.perf_counter() - start, "machine": C.machine()}
    path = C.save_csd_memory(_OUTPUT.value, pairs, counts, _CAPACITY.value, meta)
    print(f"CSD memory: {len(pairs)} pairs from {summary['mismatches']} mismatches over "
          f"{summary['positions_compared']} positions ({len(calib)} prompts, {meta['generated_tokens']} tokens); "
          f"{meta['pairs_above_default_min_count']} pairs with count > 6; saved to {path}")
    for p in top[:10]:
        print(f"  {p['count']:6d}  draft {p['draft']!r:>14} -> target {p['target']!r}")
    if held_out:
        _paths.set_status(lambda: f"the memory is saved, complete, in {path}; stopped during the held-out evaluation "
                                  f"(--eval_prompts {_EVAL.value}), which only prints its table and adds it to "
                                  f"{path / 'calibration.json'}: run again for it")
        meta["eval"] = evaluate(target, held_out, str(path))
        C.write_text(path / "calibration.json", json.dumps(C.jsonable(meta), indent=1))


def evaluate(target, texts, memory_path) -> dict:
    ids = C.encode(target.tokenizer, texts, FLAGS.chat)
    draft = C.resolve_draft(FLAGS.draft, FLAGS.model)
    opts = {k: v for k, v in (("min_count", _MIN_COUNT.value), ("tau", _TAU.value)) if v is not None}
    memory = C.load_csd_memory(memory_path, target.config.vocab_size)
    runs = {}
    for name, method, extra in (("exact", "greedy", {}),
                                ("csd, empty memory", "csd", {**opts, "csd_memory": _CAPACITY.value}),
                                ("csd, calibrated memory", "csd", {**opts, "csd_memory": memory})):
        engine = C.make_engine(target, draft, method, _K.value, FLAGS.max_new_tokens, **extra)
        runs[name] = C.run(engine, ids, 1, label=f"eval {name}: ", progress=True)
    exact = runs["exact"].tokens
    print(f"\nheld-out evaluation: {len(ids)} prompts, k={_K.value}, {FLAGS.max_new_tokens} new tokens, batch 1")
    print("| run | tau | loose share | divergence vs exact |")
    print("|---|---|---|---|")
    out = {}
    for name, r in runs.items():
        div = C.divergence(r.tokens, exact)["divergence"]
        print(f"| {name} | {r.stats['tau']:.3f} | {r.stats.get('loose_share', 0.0):.3f} | {div:.3f} |")
        out[name] = {"tau": r.stats["tau"], "loose_share": r.stats.get("loose_share"), "divergence": div,
                     "tokens_per_s": r.tokens_per_s}
    return out


if __name__ == "__main__":
    C.run_main(main)
