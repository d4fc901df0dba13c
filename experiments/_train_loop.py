"""The training loop both draft trainers share: resumable (orbax), logged, evaluated.

A trainer supplies the step (params, optimizer state, the batch's row indices, a PRNG key) and
an evaluation; the loop owns what must be identical between them: the batch rows of a step
(seeded by the step, so a resumed run draws the same batches as an uninterrupted one), the
checkpoints, the progress lines and work/metrics.jsonl.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Callable

import numpy as np

from experiments import _common as C


def run(params, optimizer, work: pathlib.Path, *, step_fn: Callable, evaluate: Callable, n: int,
        tokens_per_row: float, steps: int, batch: int, seed: int, log_every: int, eval_every: int,
        ckpt_every: int, stop_after: int = 0, schedule: Callable | None = None):
    """Runs (or resumes) `steps` optimizer steps; returns the trained params (None after stop_after).

    step_fn(params, opt_state, rows_B, key) -> (params, opt_state, losses: dict[str, scalar],
    tokens: number of trained positions); evaluate(params) -> dict (logged and recorded as "eval").
    """
    import jax
    import orbax.checkpoint as ocp

    opt_state = optimizer.init(params)
    mngr = ocp.CheckpointManager((work / "ckpt").resolve(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    step0 = 0
    if mngr.latest_step() is not None:
        step0 = mngr.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"train": params, "opt": opt_state})
        restored = mngr.restore(step0, args=ocp.args.StandardRestore(abstract))
        params, opt_state = restored["train"], restored["opt"]
        C.log(f"resumed from the checkpoint of step {step0}")

    def record(row):
        with open(work / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def evaluate_at(step):
        row = evaluate(params)
        C.log(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if np.isscalar(v)))
        record({"step": step, "eval": row})

    if step0 == 0:
        evaluate_at(0)
    window_tokens, window_start, losses = 0.0, time.perf_counter(), []
    for step in range(step0, steps):
        rows = np.random.default_rng([seed, step]).choice(n, size=batch, replace=n < batch)  # same after a resume
        key = jax.random.PRNGKey(seed * 1_000_003 + step)
        params, opt_state, step_losses, tokens = step_fn(params, opt_state, rows, key)
        losses.append({k: float(v) for k, v in step_losses.items()})
        window_tokens += float(tokens)
        done = step + 1
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
            mngr.save(done, args=ocp.args.StandardSave({"train": params, "opt": opt_state}))
            mngr.wait_until_finished()
        if done % eval_every == 0 or done == steps:
            evaluate_at(done)
        if stopping:
            C.log(f"stopping after {stop_after} steps (--stop_after)")
            return None
    mngr.wait_until_finished()
    return params
