r"""Builds CSD's correction memory offline from unlabeled prompts, and saves it with orbax.

    python experiments/calibrate_csd.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --dataset humaneval --num_prompts 40 \
        --output /tmp/csd_memory --eval_prompts 10
    python experiments/generate.py ... --method csd --csd_memory /tmp/csd_memory

Procedure: the target decodes every prompt greedily (natural EOS end); then both
models are teacher-forced on each prompt + continuation (`Model.logits`, one
forward each). At every position the draft would draft at, the draft's argmax d
and the target's argmax t are compared, and each disagreement counts one for the
pair (d, t). `--positions rounds` counts only what exact speculative decoding with
K drafts examines: the first mismatch of each round. Only the token pairs and
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

from specjax import models

try:
    from experiments import _common as C, _rounds as R
except ImportError:
    import _common as C
    import _rounds as R

_MODEL = flags.DEFINE_string("model", models.DEFAULT_PRESET, "Target model (preset, .gguf, HF directory, "
                             f"{C.RANDOM}[:SEED]).")
_DRAFT = flags.DEFINE_string("draft", None, "Draft model (preset, .gguf, HF directory, random:tiny[:SEED]) or "
                             "self:N. Required.")
_DATASET = flags.DEFINE_enum("dataset", "mtbench", list(C.DATASETS), "Prompt source (unless --prompts_file).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "Text file, one prompt per line (replaces --dataset).")
_NUM = flags.DEFINE_integer("num_prompts", 40, "Calibration prompts: the first N after --prompt_offset.")
_OFFSET = flags.DEFINE_integer("prompt_offset", 0, "Skip this many prompts first.")
_CHAT = flags.DEFINE_boolean("chat", True, "Wrap prompts in the chat template.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Greedy continuation length per prompt (EOS may stop earlier).")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Prompts per greedy-decoding call.")
_POSITIONS = flags.DEFINE_enum("positions", "all", ["all", "rounds"],
                               "all: every drafted position; rounds: first mismatch of each exact round (--k).")
_K = flags.DEFINE_integer("k", 8, "Draft length for --positions rounds and for --eval_prompts.")
_CAPACITY = flags.DEFINE_integer("capacity", 1 << 16, "Memory capacity (distinct pairs).")
_BUCKET = flags.DEFINE_integer("bucket", 128, "Teacher-forcing buffers are padded to a multiple of this.")
_OUTPUT = flags.DEFINE_string("output", None, "Directory to save the memory in (orbax). Required.")
_EVAL = flags.DEFINE_integer("eval_prompts", 0, "Held-out prompts to compare empty vs calibrated memory on.")
_MIN_COUNT = flags.DEFINE_integer("min_count", None, "csd min_count for --eval_prompts (unset: rule default).")
_TAU = flags.DEFINE_float("tau", None, "csd tau for --eval_prompts (unset: rule default).")
flags.mark_flags_as_required(["draft", "output"])


def _validate():
    for name in ("num_prompts", "max_new_tokens", "batch_size", "k", "capacity", "bucket"):
        if flags.FLAGS[name].value <= 0:
            raise app.UsageError(f"--{name} must be positive, got {flags.FLAGS[name].value}")
    if _EVAL.value < 0 or _OFFSET.value < 0:
        raise app.UsageError("--eval_prompts and --prompt_offset must be >= 0")


def count_pairs(target, draft, seqs, prompt_lens, positions: str, k: int, bucket: int):
    """(pairs int32[P, 2], counts int32[P], summary) of the draft/target disagreements."""
    found, compared, truncated = [], 0, 0
    for i, (seq, P) in enumerate(zip(seqs, prompt_lens)):
        t_Q, d_Q, _ = R.argmax_and_regret(target, draft, seq, bucket)
        end = R.consistent_end(t_Q, seq, P)
        truncated += end < len(seq) - 1
        if positions == "all":
            q = np.arange(P, end)
            compared += len(q)
        else:
            rounds = R.exact_rounds(t_Q, d_Q, P, end, k)
            q = np.asarray([r.L + r.b for r in rounds if r.mismatch], np.int64)
            compared += sum(r.b + r.mismatch for r in rounds)  # drafts the rounds examined
        q = q[d_Q[q] != t_Q[q]]
        found.append(np.stack([d_Q[q], t_Q[q]], axis=1) if len(q) else np.zeros((0, 2), np.int64))
        if (i + 1) % 10 == 0:
            C.log(f"teacher forcing: {i + 1}/{len(seqs)} sequences")
    all_pairs = np.concatenate(found) if found else np.zeros((0, 2), np.int64)
    if len(all_pairs):
        pairs, counts = np.unique(all_pairs, axis=0, return_counts=True)
    else:
        pairs, counts = np.zeros((0, 2), np.int64), np.zeros((0,), np.int64)
    summary = {"positions_compared": int(compared), "mismatches": int(len(all_pairs)),
               "distinct_pairs": int(len(pairs)), "sequences_cut_at_a_near_tie": int(truncated)}
    return pairs.astype(np.int32), counts.astype(np.int32), summary


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    _validate()
    logging.set_verbosity(logging.WARNING)
    start = time.perf_counter()
    dataset = None if _PROMPTS_FILE.value else _DATASET.value
    texts = C.read_prompts(None, _PROMPTS_FILE.value, dataset, None)
    calib = texts[_OFFSET.value: _OFFSET.value + _NUM.value]
    held_out = texts[_OFFSET.value + _NUM.value: _OFFSET.value + _NUM.value + _EVAL.value]
    if not calib:
        raise app.UsageError("no calibration prompts (check --prompt_offset / --num_prompts)")
    if len(held_out) < _EVAL.value:
        raise app.UsageError(f"--eval_prompts {_EVAL.value}: only {len(held_out)} prompts left after the "
                             "calibration ones")
    target = C.load_model(_MODEL.value)
    draft = C.draft_model(_DRAFT.value, target)
    tok = target.tokenizer
    ids = C.encode(tok, calib, _CHAT.value)
    C.log(f"calibrating on {len(ids)} prompts: target greedy decoding ({_MAX_NEW.value} new tokens) ...")
    seqs = R.greedy_sequences(target, ids, _MAX_NEW.value, _BATCH.value)
    C.log("teacher forcing both models ...")
    pairs, counts, summary = count_pairs(target, draft, seqs, [len(p) for p in ids], _POSITIONS.value, _K.value,
                                         _BUCKET.value)
    if len(pairs) > _CAPACITY.value:
        keep = np.argsort(-counts, kind="stable")[: _CAPACITY.value]
        C.log(f"{len(pairs)} distinct pairs > capacity {_CAPACITY.value}: keeping the most frequent")
        pairs, counts = pairs[keep], counts[keep]
    order = np.argsort(-counts, kind="stable")
    top = [{"draft": tok.decode([int(pairs[i, 0])]), "target": tok.decode([int(pairs[i, 1])]),
            "draft_id": int(pairs[i, 0]), "target_id": int(pairs[i, 1]), "count": int(counts[i])}
           for i in order[:20]]
    meta = {"target": _MODEL.value, "draft": _DRAFT.value, "vocab_size": target.config.vocab_size,
            "dataset": dataset, "prompts_file": _PROMPTS_FILE.value, "prompt_offset": _OFFSET.value,
            "num_prompts": len(calib), "chat": _CHAT.value, "max_new_tokens": _MAX_NEW.value,
            "generated_tokens": int(sum(len(s) - len(p) for s, p in zip(seqs, ids))),
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
        meta["eval"] = evaluate(target, held_out, str(path))
        (path / "calibration.json").write_text(json.dumps(C.jsonable(meta), indent=1))


def evaluate(target, texts, memory_path) -> dict:
    ids = C.encode(target.tokenizer, texts, _CHAT.value)
    draft = C.resolve_draft(_DRAFT.value, _MODEL.value)
    opts = {k: v for k, v in (("min_count", _MIN_COUNT.value), ("tau", _TAU.value)) if v is not None}
    memory = C.load_csd_memory(memory_path, target.config.vocab_size)
    runs = {}
    for name, method, extra in (("exact", "greedy", {}),
                                ("csd, empty memory", "csd", {**opts, "csd_memory": _CAPACITY.value}),
                                ("csd, calibrated memory", "csd", {**opts, "csd_memory": memory})):
        engine = C.make_engine(target, draft, method, _K.value, _MAX_NEW.value, **extra)
        runs[name] = C.run(engine, ids, 1, label=f"eval {name}: ", progress=True)
    exact = runs["exact"].tokens
    print(f"\nheld-out evaluation: {len(ids)} prompts, k={_K.value}, {_MAX_NEW.value} new tokens, batch 1")
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
    app.run(main)
