"""What experiments/profile_step.py measures with: XLA's per-operation times from a profiler trace
(no absl flags here, so tests import it freely)."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile


def profile_ops(fn, args, steps=10) -> list[tuple[str, float, float]]:
    """(operation name, ms per step, calls per step) of the compiled program, largest first."""
    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(steps):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))
        if not files:
            raise RuntimeError("the profiler wrote no trace")
        with gzip.open(files[-1]) as f:
            events = json.load(f)["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for e in events:  # the program's own operations (thunks); host-side Python frames start with "$"
        name = e.get("name", "")
        if e.get("ph") == "X" and not name.startswith("$") and "Thunk" not in name and "Execute" not in name \
                and "PjitFunction" not in name:
            total[name] += e["dur"] / 1e3
            calls[name] += 1
    return [(n, ms / steps, calls[n] / steps) for n, ms in total.most_common()]
