"""The training loop both draft trainers share: resumable (orbax), checked, logged, evaluated.

A trainer supplies the step (params, optimizer state, the batch's row indices, a PRNG key) and
an evaluation; the loop owns what must be identical between them: the batch rows of a step
(seeded by the step, so a resumed run draws the same batches as an uninterrupted one), the
checkpoints, the progress lines and work/metrics.jsonl.

Checkpoints: orbax keeps the last two under work/ckpt/STEP; orbax's files carry no checksum, so
each step directory gets a SHA-256 manifest (`specjax._files`) once orbax has finished it. A
resume takes the newest checkpoint whose files match their manifest; newer ones that do not (a
flipped bit, a cut file, a save cut short) are named and moved to work/damaged/. A loss that is not
finite stops the run at that step: nothing after it is saved, and the error says where the last
good checkpoint is.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import time
from typing import Callable

import numpy as np

from specjax import _files

from experiments import _common as C
from experiments import _paths


def checkpoint_steps(ckpt: pathlib.Path) -> list[int]:
    """The steps of the checkpoints under `ckpt`, newest first (orbax's temporaries are not steps)."""
    if not ckpt.is_dir():
        return []
    return sorted((int(p.name) for p in ckpt.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)


def unverified_checkpoint(work: pathlib.Path) -> int | None:
    """The newest checkpoint step of a work directory whose checkpoints all lack checksum manifests: one
    made by an earlier version of the trainer, before they were recorded (or whose only save was cut
    between orbax's commit and the manifest). None when there is no checkpoint or any has a manifest."""
    steps = checkpoint_steps(work / "ckpt")
    if steps and not any((work / "ckpt" / str(s) / _files.MANIFEST).exists() for s in steps):
        return steps[0]
    return None


def usable_checkpoint(work: pathlib.Path) -> int | None:
    """The newest checkpoint step whose files match their manifest (None: no checkpoint). Newer ones
    that do not are moved to work/damaged/ with a line each; when none matches, RunError."""
    ckpt = work / "ckpt"
    steps = checkpoint_steps(ckpt)
    bad = []
    for step in steps:
        try:
            _files.check_manifest(ckpt / str(step))
        except _files.LoadError as e:
            bad.append((step, e))
            continue
        for b, e in bad:
            aside = work / "damaged" / f"ckpt_{b}_{time.strftime('%Y%m%d-%H%M%S')}"
            aside.parent.mkdir(exist_ok=True)
            shutil.move(str(ckpt / str(b)), aside)
            C.log(f"checkpoint of step {b} is damaged ({e}); moved to {aside}; resuming from step {step}")
        return step
    if bad:
        raise _paths.RunError(f"no intact checkpoint in {ckpt} ({bad[0][1]}); remove {ckpt} to train from the start")
    return None


def finite(tree) -> bool:
    import jax

    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


def run(params, optimizer, work: pathlib.Path, *, step_fn: Callable, evaluate: Callable, n: int,
        tokens_per_row: float, steps: int, batch: int, seed: int, log_every: int, eval_every: int,
        ckpt_every: int, stop_after: int = 0, schedule: Callable | None = None, diverged_hint: str = ""):
    """Runs (or resumes) `steps` optimizer steps; returns the trained params (None after stop_after).

    step_fn(params, opt_state, rows_B, key) -> (params, opt_state, losses: dict[str, scalar],
    tokens: number of trained positions); evaluate(params) -> dict (logged and recorded as "eval").
    A non-finite loss or parameter raises _paths.RunError naming the step, `diverged_hint` (the
    likely cause) and the last good checkpoint.
    """
    import jax
    import orbax.checkpoint as ocp

    opt_state = optimizer.init(params)
    ckpt = (work / "ckpt").resolve()
    # A work directory from before checksums is adopted, not refused (hours of training): its newest
    # checkpoint must restore into this run's shapes and hold finite values; then its manifest is written.
    legacy = unverified_checkpoint(work)
    step0 = legacy or usable_checkpoint(work) or 0
    mngr = ocp.CheckpointManager(ckpt, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    if step0:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"train": params, "opt": opt_state})
        unchecked = (" (without checksums: an earlier version's; run with the settings that made it, or remove "
                     f"{ckpt} to train from the start)") if legacy else f"; remove {ckpt} to train from the start"
        try:
            restored = mngr.restore(step0, args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many types; one line says it)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise _paths.RunError(f"cannot restore the checkpoint {ckpt / str(step0)} ({type(e).__name__}: "
                                  f"{first}){unchecked}") from None
        params, opt_state = restored["train"], restored["opt"]
        if legacy:
            if not finite({"train": params, "opt": opt_state}):
                raise _paths.RunError(f"the checkpoint {ckpt / str(step0)} holds values that are not finite"
                                      f"{unchecked}")
            _files.write_manifest(ckpt / str(step0))
            C.log(f"the checkpoint of step {step0} has no checksums (made before they were recorded): it restores "
                  f"with this run's shapes and its values are finite, so it is adopted and its checksums written now")
        C.log(f"resumed from the checkpoint of step {step0}")
    state = {"step": step0, "saved": step0}
    _paths.set_status(lambda: f"training stopped at step {state['step']}/{steps}; " + (
        f"the last checkpoint is step {state['saved']} in {ckpt}, where the same command continues"
        if state["saved"] else "no checkpoint yet (the data made so far are kept)"))

    def record(row):
        with open(work / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def evaluate_at(step):
        row = evaluate(params)
        C.log(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if np.isscalar(v)))
        record({"step": step, "eval": row})

    def diverged(step, what):
        last = f"step {state['saved']} in {ckpt}" if state["saved"] else "none (no checkpoint was saved)"
        hint = f" ({diverged_hint})" if diverged_hint else ""
        raise _paths.RunError(f"step {step}: {what}: training diverged{hint}; stopped, nothing exported; "
                              f"the last good checkpoint: {last}")

    if step0 == 0:
        evaluate_at(0)
    window_tokens, window_start, losses = 0.0, time.perf_counter(), []
    for step in range(step0, steps):
        rows = np.random.default_rng([seed, step]).choice(n, size=batch, replace=n < batch)  # same after a resume
        key = jax.random.PRNGKey(seed * 1_000_003 + step)
        params, opt_state, step_losses, tokens = step_fn(params, opt_state, rows, key)
        values = {k: float(v) for k, v in step_losses.items()}
        done = step + 1
        state["step"] = done
        bad = [f"{k} {v}" for k, v in values.items() if not math.isfinite(v)]
        if bad:
            diverged(done, ", ".join(bad))
        losses.append(values)
        window_tokens += float(tokens)
        if done % log_every == 0 or done == steps:
            el = time.perf_counter() - window_start
            mean = {k: float(np.mean([row[k] for row in losses])) for k in losses[0]}
            lr = f", lr {float(schedule(step)):.2e}" if schedule is not None else ""
            C.log(f"step {done}/{steps}: " + ", ".join(f"{k} {v:.3f}" for k, v in mean.items())
                  + f"{lr}, {window_tokens / el:.0f} tokens/s")
            record({"step": done, **mean, "tokens_per_s": window_tokens / el,
                    "tokens_seen": done * batch * tokens_per_row})
            window_tokens, window_start, losses = 0.0, time.perf_counter(), []
        stopping = bool(stop_after) and done - step0 >= stop_after
        if done % ckpt_every == 0 or done == steps or stopping:  # a stopped run keeps its last step
            if not finite(params):  # the loss was finite, the update that followed was not
                diverged(done, "the parameters after it are not finite")
            mngr.save(done, args=ocp.args.StandardSave({"train": params, "opt": opt_state}))
            mngr.wait_until_finished()
            _files.write_manifest(ckpt / str(done))  # last: a checkpoint without it is incomplete
            state["saved"] = done
        if done % eval_every == 0 or done == steps:
            evaluate_at(done)
        if stopping:
            C.log(f"stopping after {stop_after} steps (--stop_after)")
            return None
    mngr.wait_until_finished()
    if not finite(params):
        diverged(steps, "the parameters are not finite")
    return params


def step_cost(run_t: Callable, run_d: Callable, target_params, draft_params, rounds: int, context: int) -> dict:
    """Bytes of parameters and median seconds of one step, draft against target: `run_t` and `run_d`
    (compiled, each one step, blocking) are timed interleaved (target, draft, target, ...) so that
    machine load hits both alike."""
    from specjax.models import quant

    tt, td = [], []
    for _ in range(rounds):
        for fn, acc in ((run_t, tt), (run_d, td)):
            s = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - s)
    tb, db = quant.param_bytes(target_params), quant.param_bytes(draft_params)
    return {"target_bytes": tb, "draft_bytes": db, "bytes_ratio": db / tb,
            "target_step_ms": 1e3 * float(np.median(tt)), "draft_step_ms": 1e3 * float(np.median(td)),
            "time_ratio": float(np.median(td) / np.median(tt)), "rounds": rounds, "context": context}


def agreement_stats(agree, valid, k: int) -> dict:
    """{"agree": share of valid positions where the draft agreed, "tau_at_k": mean over valid
    positions of 1 + the run of agreements starting there, capped at k}: what a round of exact
    verification starting at each position would accept, had the draft seen the true context."""
    runs = np.zeros(agree.shape, np.int64)
    for j in range(k):
        ok = np.ones(agree.shape, bool)
        for t in range(j + 1):
            shifted = np.zeros(agree.shape, bool)
            shifted[:, : agree.shape[1] - t] = agree[:, t:]
            ok &= shifted
        runs += ok
    return {"agree": float(agree[valid].mean()), f"tau_at_{k}": float(1.0 + runs[valid].mean())}
