"""Exact speculative rounds reconstructed from teacher forcing (the calibration binaries).

The target decodes a prompt greedily; both models then run once over prompt +
continuation (`Model.logits`). Exact speculative decoding emits exactly the
target's greedy tokens, and while a round's drafts match, the draft model has
seen exactly those tokens too, so each round's first mismatch, and the target's
logits there, can be read off the two forwards (`exact_rounds`).

A draft of another vocabulary cannot be teacher-forced on the target's ids. Its exact rounds are
run instead: its drafter (`cross_draft.CrossVocabDrafter`, as the Engine builds it for K) proposes
at each round's pending token along the target's greedy sequence, and the round ends where a
translated draft differs from the target's token (`drafted_in_rounds`). The positions it drafted
then hold its drafts; a position no round drafted holds -1, which `exact_rounds` reads as the end
of the round there, and which has no pair and no regret.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import NamedTuple, Sequence

import numpy as np

from specjax import cross_draft, drafters, models

from experiments import _common as C


def teacher_forced(model: models.Model, seq: Sequence[int], bucket: int = 128):
    """float32[len(seq), V] logits (row q predicts seq[q + 1]) of one sequence, on the device.

    The sequence is right-padded to a multiple of `bucket` (causal attention ignores
    the padding) so that `Model.logits` compiles once per bucket, not per length."""
    import jax.numpy as jnp

    T = len(seq)
    buf = np.zeros((1, -(-T // bucket) * bucket), np.int32)
    buf[0, :T] = seq
    return model.logits(jnp.asarray(buf))[0, :T]


class Round(NamedTuple):
    L: int  # position of the round's pending token
    b: int  # drafts matched before the first mismatch (K: none; fewer when the sequence ends or
    #         the round drafted fewer: a -1 in d_Q)
    mismatch: bool  # the round stopped on a mismatch at draft position b (b < K)


def exact_rounds(t_Q: np.ndarray, d_Q: np.ndarray, start: int, end: int, k: int) -> list[Round]:
    """Rounds of exact speculative decoding along a target-greedy sequence, from teacher forcing.

    t_Q / d_Q: the target's / draft's argmax at each position q (predicting token q + 1); a d_Q of
    -1 (a draft of another vocabulary: `RoundDriver`) ends the round there without a mismatch.
    A round whose pending token sits at L drafts d_Q[L .. L+K-1] (while its drafts
    match, the draft saw exactly the target's tokens: its greedy drafts are these)
    and commits its b matching drafts plus the target's token. Rounds run while
    L < end, the position of the last emitted token; the first pending token is
    the prefill's, at `start` (the prompt length).
    """
    rounds, L = [], start
    while L < end:
        b, mismatch = k, False
        for i in range(k):
            if L + i >= end or d_Q[L + i] < 0:  # the sequence ends inside this round, or its drafts do
                b = i
                break
            if d_Q[L + i] != t_Q[L + i]:
                b, mismatch = i, True
                break
        rounds.append(Round(L, b, mismatch))
        L += b + 1
    return rounds


def asd_block_values(t_Q, d_Q, regret_Q, start: int, end: int, k: int) -> tuple[list[float], list[Round]]:
    """ASD's calibration values along one sequence, and its exact rounds: for each round
    (block) whose first mismatch b < K has a positive regret r_b, r_b / ((K - b) / K)."""
    rounds = exact_rounds(t_Q, d_Q, start, end, k)
    values = [float(regret_Q[r.L + r.b]) / ((k - r.b) / k) for r in rounds
              if r.mismatch and regret_Q[r.L + r.b] > 0]
    return values, rounds


def consistent_end(t_Q: np.ndarray, seq: Sequence[int], prompt_len: int) -> int:
    """Last position whose token the teacher-forced target reproduces greedily: `seq` is
    target-greedy up to there (a near-tie decided differently by the cached decode
    and the full forward ends the usable part)."""
    seq = np.asarray(seq)
    for q in range(prompt_len - 1, len(seq) - 1):
        if t_Q[q] != seq[q + 1]:
            return q
    return len(seq) - 1




def greedy_sequences(target: models.Model, ids: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int,
                     progress: bool = True) -> list[list[int]]:
    """prompt + the target's greedy continuation (natural EOS end) of every prompt."""
    engine = C.make_engine(target, None, "greedy", 1, max_new_tokens)
    out = C.run(engine, ids, batch_size, label="target greedy: ", progress=progress)
    return [list(p) + list(t) for p, t in zip(ids, out.tokens)]


class RoundDriver:
    """A draft of another vocabulary driven through exact speculative rounds on the host: its
    drafter as the Engine builds it for `k` (translation included), the propose step jitted
    once (batch 1; buffers padded to a multiple of `bucket`)."""

    def __init__(self, target: models.Model, draft: models.Model, k: int, bucket: int = 128):
        import jax

        self.drafter, self.params = drafters.from_spec(draft, target, k)
        self.k, self.bucket = k, bucket
        self._init = jax.jit(self.drafter.init, static_argnums=3)
        key = jax.random.PRNGKey(0)  # greedy: unused
        self._propose = jax.jit(lambda p, st, s, L: self.drafter.propose(p, st, s, L, key, 0.0))

    def drafted_in_rounds(self, seq: Sequence[int], start: int) -> np.ndarray:
        """int32[len(seq)]: the drafts of exact speculative decoding along `seq` (prompt of `start`
        tokens + the target's greedy continuation, which exact decoding emits). A round pending
        at L proposes with seq[:L + 1] committed (the buffer holds nothing past it); its drafts
        fill L, L + 1, ... up to and including the first that differs from the target's token,
        and the next round is pending after it (after the target's bonus token where all
        matched: that position stays -1, as where a round proposed nothing)."""
        import jax.numpy as jnp

        T = len(seq)
        pad = lambda n: -(-n // self.bucket) * self.bucket  # noqa: E731
        S = pad(T + self.k + 2)
        prompt = np.zeros((1, pad(start)), np.int32)
        prompt[0, :start] = seq[:start]
        state = self._init(self.params, jnp.asarray(prompt), jnp.asarray([start], np.int32), S)
        buf = np.zeros((1, S), np.int32)
        d_Q = np.full(T, -1, np.int32)
        L = start
        while L < T - 1:
            buf[0, :L + 1] = seq[:L + 1]  # what the rounds committed: the pending token at L last
            ids, num, _, state = self._propose(self.params, state, jnp.asarray(buf), jnp.asarray([L], np.int32))
            ids, num = np.asarray(ids[0]), int(num[0])
            b = 0
            while b < num and L + b < T - 1:
                d_Q[L + b] = ids[b]
                if ids[b] != seq[L + b + 1]:
                    break
                b += 1
            L += b + 1
        return d_Q


def argmax_and_regret(target: models.Model, draft: models.Model, seq: Sequence[int], bucket: int = 128, *,
                      driver: RoundDriver | None = None, start: int | None = None):
    """Teacher forcing of both models on one sequence: per position q (predicting token q + 1),
    the target's argmax t, the draft's argmax d, and the target's logit regret of d,
    max L[q] - L[q][d[q]], from the statistics the verify rules read (`pallas.gate_stats`).
    NumPy arrays of len(seq). With a `driver` (a draft of another vocabulary), d is its drafts in
    the exact rounds from the prompt's `start` (`RoundDriver.drafted_in_rounds`; -1 where none,
    with regret 0)."""
    import jax.numpy as jnp

    from specjax import pallas

    target_logits = teacher_forced(target, seq, bucket)
    if driver is None:
        d_Q = np.asarray(pallas.gate_stats(teacher_forced(draft, seq, bucket)).argmax)
    else:
        d_Q = driver.drafted_in_rounds(seq, start)
    target_stats = pallas.gate_stats(target_logits, jnp.asarray(np.maximum(d_Q, 0)))
    regret_Q = np.where(d_Q >= 0, np.asarray(target_stats.max_logit - target_stats.token_logit), 0.0)
    return np.asarray(target_stats.argmax), d_Q, regret_Q.astype(np.float32)


class Forced(NamedTuple):
    """One calibration sequence: prompt + the target's greedy continuation, and per position q
    (predicting token q + 1) the target's argmax, the draft's argmax and the target's regret of it."""
    seq: np.ndarray  # int32[T]
    t_Q: np.ndarray  # int32[T]
    d_Q: np.ndarray  # int32[T]
    regret_Q: np.ndarray  # float32[T]


# Where a calibration run stands and where its decoded sequences are cached, for the line Ctrl-C prints.
_PROGRESS = {"stage": "loading the models", "cached": None}


def stage(what: str) -> None:
    _PROGRESS["stage"] = what


def interrupt_status(output: str, cache_dir: str | None) -> str:
    """Where an interrupted calibration stood and what of it is saved (`output`: what it writes at the end)."""
    line = f"stopped while {_PROGRESS['stage']}; {output} is written only at the end, so it is not there"
    if _PROGRESS["cached"]:
        return line + (f"; the decoded sequences and their teacher forcing are saved in {_PROGRESS['cached']}, "
                       "which the same command reads back")
    if cache_dir:
        return line + "; --cache_dir keeps the decoded sequences once both models are teacher-forced"
    return line + "; nothing is saved (--cache_dir would keep the decoded sequences)"


def _spec_identity(spec: str) -> str:
    """A model spec plus, for a file or directory, its size and mtime (a replaced file is another model)."""
    if os.path.exists(spec):
        st = os.stat(spec)
        return f"{os.path.abspath(spec)}:{st.st_size}:{st.st_mtime_ns}"
    return spec


def calibration_data(target: models.Model, draft: models.Model, ids: Sequence[Sequence[int]], *,
                     target_spec: str, draft_spec: str, max_new_tokens: int, batch_size: int, bucket: int,
                     k: int, cache_dir: str | None = None) -> list[Forced]:
    """Greedy decoding of every prompt, then teacher forcing of both models (`argmax_and_regret`);
    a draft of another vocabulary is driven through the exact rounds at K = `k` instead (its
    drafts depend on K; a draft of the target's vocabulary does not use `k`).

    With `cache_dir`, the result is stored under a key of the models, prompts and lengths
    (and K for a draft of another vocabulary) and read back by the next run on the same inputs
    (calibrate_csd then calibrate_asd)."""
    path = None
    cross = not cross_draft.same_vocab(target, draft)
    if cache_dir:
        key = json.dumps({"target": _spec_identity(target_spec), "draft": _spec_identity(draft_spec),
                          "ids": [list(map(int, p)) for p in ids], "max_new_tokens": max_new_tokens,
                          "bucket": bucket, "version": 1, **({"rounds_k": k} if cross else {})})
        path = pathlib.Path(cache_dir) / f"calibration-{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"
        if path.exists():
            with np.load(path) as z:
                lens = np.cumsum(z["lengths"])[:-1]
                parts = [np.split(z[name], lens) for name in Forced._fields]
            C.log(f"read {len(ids)} greedy sequences and their teacher forcing from {path}")
            _PROGRESS["cached"] = path
            return [Forced(*row) for row in zip(*parts)]
    stage(f"decoding {len(ids)} prompts greedily with the target")
    C.log(f"{len(ids)} prompts: target greedy decoding ({max_new_tokens} new tokens) ...")
    seqs = greedy_sequences(target, ids, max_new_tokens, batch_size)
    out = []
    driver = RoundDriver(target, draft, k, bucket) if cross else None
    for i, seq in enumerate(seqs):
        stage(f"teacher-forcing both models on the target's greedy sequences ({i}/{len(seqs)} done)")
        if i == 0:
            C.log("teacher forcing both models ...")
        t_Q, d_Q, regret_Q = argmax_and_regret(target, draft, seq, bucket, driver=driver, start=len(ids[i]))
        out.append(Forced(np.asarray(seq, np.int32), t_Q.astype(np.int32), d_Q.astype(np.int32), regret_Q))
        if (i + 1) % 10 == 0:
            C.log(f"teacher forcing: {i + 1}/{len(seqs)} sequences")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, lengths=np.asarray([len(f.seq) for f in out]),
                 **{name: np.concatenate([getattr(f, name) for f in out]) for name in Forced._fields})
        os.replace(tmp, path)
        _PROGRESS["cached"] = path
        C.log(f"cached in {path}")
    return out
