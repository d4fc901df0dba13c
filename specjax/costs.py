"""What a round costs on a platform: the table the adaptive loop weighs draft widths against.

`CostTable` holds the seconds of one target verify forward at each width w = 1 .. K + 1
(`verify_s[w - 1]`) and of one draft-model step (`draft_step_s`, 0 for prompt lookup). The
compiled loop (`loop.Program`, `adaptive=True`) reads it as a runtime input; it never calls
into this module. The Engine either takes a table (`Engine(..., costs=CostTable(...))`) or
measures one here, once per engine configuration and batch size on its own platform, and keeps
it on disk under the specjax cache directory (`costs/`), keyed by everything the timing depends
on: specjax's own source (a changed loop is measured again), platform, CPU model, the target's
and draft's configs, dtype, backend, batch size, K and the mesh. With several processes (one mesh over hosts) every process takes process 0's figures: the
loop's choices must be the same program everywhere.

`CostTable.from_ratios` builds a table from a published profile (a verify pass of width w
costs r_w target steps), e.g. a device's figures read off a results file.

Measuring (`measured`): a whole round of the engine's own adaptive loop at each compiled width,
forced through the cost input, a few rounds in a compiled loop as the while_loop runs them
(drafting, the target's forward, the rule, the commit and the policy's bookkeeping all counted:
on a CPU a round of a small model costs well more than its bare forward), the fastest of 5
calls after a warm-up; and, for a draft model whose steps the loop chooses, one draft step,
which is then counted apart (the loop adds w - 1 draft steps to a width's verify cost before
drafting, and weighs only the verify once the drafts are made). Widths that are not compiled
are interpolated linearly. The figures are kept per engine configuration (drafter, the rule's
kind, K, sampling), in this process and on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform as _platform
import time
import warnings
from typing import Mapping, Sequence

_FORMAT = "specjax-costs-2"
_MEMORY: dict[str, tuple[float, ...]] = {}  # key -> measured seconds, for the engines of this process


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostTable:
    """Seconds per verify width and per draft step on one platform.

    verify_s: seconds of one target forward over w positions, for w = 1 .. K + 1 (index w - 1).
    draft_step_s: seconds of one draft-model step (0 for a drafter without a model: prompt lookup).
    platform, source: where the figures come from (shown in results; not used by the loop).
    """

    verify_s: tuple[float, ...]
    draft_step_s: float = 0.0
    platform: str = ""
    source: str = ""

    def __post_init__(self):
        if isinstance(self.verify_s, (str, bytes)) or not isinstance(self.verify_s, Sequence) or not self.verify_s:
            raise ValueError(f"CostTable.verify_s must be a non-empty sequence of seconds (width 1 first), "
                             f"got {self.verify_s!r:.80}")
        values = []
        for i, v in enumerate(self.verify_s):
            values.append(_seconds(f"verify_s[{i}] (width {i + 1})", v, positive=True))
        object.__setattr__(self, "verify_s", tuple(values))
        object.__setattr__(self, "draft_step_s", _seconds("draft_step_s", self.draft_step_s, positive=False))

    @property
    def k(self) -> int:
        """The largest K this table covers (widths 1 .. K + 1)."""
        return len(self.verify_s) - 1

    def check(self, k: int) -> "CostTable":
        """This table, if it has one entry per width 1 .. k + 1; else a ValueError naming both."""
        if len(self.verify_s) != k + 1:
            raise ValueError(f"costs: verify_s has {len(self.verify_s)} entries, but k={k} needs one per verify "
                             f"width 1 .. {k + 1} ({k + 1} entries)")
        return self

    def in_steps(self) -> tuple[tuple[float, ...], float]:
        """(verify cost per width, draft step) in target steps (verify at width 1 = 1.0)."""
        step = self.verify_s[0]
        return tuple(v / step for v in self.verify_s), self.draft_step_s / step

    @classmethod
    def from_ratios(cls, k: int, verify_ratios: Mapping[int, float], *, step_s: float = 1.0,
                    draft_ratio: float = 0.0, platform: str = "", source: str = "") -> "CostTable":
        """A table for widths 1 .. k + 1 from a profile in target steps.

        verify_ratios: {width: cost of a verify of that width in target steps}; width 1 is 1.0 if
        absent; widths between given ones are interpolated linearly, widths past the last given
        one extrapolated along the last two points (flat if only one is given).
        step_s: seconds of one target step (the table's unit; any positive number for ratios).
        draft_ratio: one draft step in target steps.
        """
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"CostTable.from_ratios: k must be an integer >= 1, got {k!r}")
        points = {1: 1.0, **{int(w): float(r) for w, r in dict(verify_ratios).items()}}
        if min(points) < 1:
            raise ValueError(f"CostTable.from_ratios: widths start at 1, got {sorted(points)}")
        step = _seconds("step_s", step_s, positive=True)
        return cls(verify_s=tuple(step * r for r in _interpolate(points, k + 1)),
                   draft_step_s=step * _seconds("draft_ratio", draft_ratio, positive=False),
                   platform=platform, source=source)


def _seconds(name: str, value, *, positive: bool) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"costs: {name} must be a number of seconds, got {value!r:.60}") from None
    if isinstance(value, bool) or not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise ValueError(f"costs: {name} must be a finite number of seconds {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")
    return x


def _interpolate(points: dict[int, float], n: int) -> list[float]:
    """Values at 1 .. n, linear between the given points, extended along the last segment."""
    xs = sorted(points)
    out = []
    for w in range(1, n + 1):
        if w in points:
            out.append(points[w])
            continue
        right = [x for x in xs if x > w]
        left = [x for x in xs if x < w]
        if right:  # left is never empty: 1 is always a point
            a, b = left[-1], right[0]
        elif len(xs) >= 2:
            a, b = xs[-2], xs[-1]
        else:
            out.append(points[xs[-1]])
            continue
        out.append(points[a] + (points[b] - points[a]) * (w - a) / (b - a))
    return out


# -- measuring (host side: the Engine calls it once per configuration and batch size) ----------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


@functools.cache
def code_digest() -> str:
    """A hash of specjax's own source (.py and the native kernels' .cc): a round's cost is the code's,
    so a changed loop, drafter or rule is measured again, not served an old figure."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith((".py", ".cc")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


def cache_key(engine, batch: int, what: str) -> str:
    """Everything a measurement depends on, hashed: `what` is "rounds" (the engine's adaptive round at
    each compiled width: drafter, the rule's kind, K and sampling included) or "draft" (one step of
    the draft model)."""
    import jax

    model = getattr(engine.drafter, "model", engine.drafter)
    parts = dict(format=_FORMAT, code=code_digest(), platform=jax.default_backend(), cpu=cpu_model(), jax=jax.__version__,
                 dtype=str(engine.target.dtype), backend=engine.backend.matmul, layers=engine.layers,
                 batch=int(batch), what=what, processes=jax.process_count())
    if engine.layout is not None:  # on a mesh a forward also pays for its collectives
        mesh = engine.layout.mesh
        parts.update(mesh=[list(mesh.axis_names), list(mesh.devices.shape)], plan=repr(engine.layout.target))
    if what == "draft":
        parts.update(draft=repr(model.config), draft_dtype=str(model.dtype))
    else:
        # the rule's kind, not its options: they hardly change what a round costs, and engines that
        # differ only in them (a name and its rule object) then weigh widths alike
        parts.update(target=repr(engine.target.config), drafter=repr(engine.drafter),
                     rule=type(engine.rule).__name__, k=engine.k, sampling=[engine.temperature, engine.top_p])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def measured(engine, batch: int) -> CostTable:
    """The engine's table for `batch` rows, from this process, from disk, or measured now: its whole
    adaptive round at each compiled width, less the draft steps of a draft model whose steps the loop
    chooses (`Drafter.truncated`), which are timed apart."""
    import jax

    from specjax import loop

    widths = loop.adaptive_widths(engine.k)
    rounds = _remembered(engine, batch, "rounds", lambda: _round_seconds(engine, batch, widths))
    draft_s = 0.0
    if engine.drafter.truncated is not None:  # the loop drafts w - 1 steps (one for a plain step)
        draft_s = _remembered(engine, batch, "draft", lambda: (_draft_seconds(engine, batch),))[0]
    seconds, floor = {}, 0.0
    for w, s in zip(widths, rounds):
        # the verify part; never below a narrower width's (a wider round costs no less), nor below
        # a tenth of the round (a draft step timed alone may cost more than inside the loop)
        floor = max(floor, s - draft_s * max(w - 1, 1), 0.1 * s)
        seconds[w] = floor
    return CostTable(verify_s=tuple(_interpolate(seconds, engine.k + 1)), draft_step_s=draft_s,
                     platform=f"{jax.default_backend()}: {cpu_model()}",
                     source=f"measured rounds, batch {batch}, widths {list(widths)}")


def _remembered(engine, batch: int, what: str, measure) -> tuple[float, ...]:
    """Figures, the same in every process: the loop's widths hang on them, and processes that
    weighed widths differently would run different programs on one mesh (and hang or abort). So
    with several processes, process 0's disk decides whether to measure, all processes measure
    together (the forward is a collective on a mesh they share) and all take process 0's figures."""
    import jax

    key = cache_key(engine, batch, what)
    if key in _MEMORY:
        return _MEMORY[key]
    path = _directory() / f"{key}.json"
    first = jax.process_index() == 0
    seconds = _agreed(_read(path) if first else None)
    if seconds is None:
        seconds = _agreed(tuple(measure()))
        if first:
            _write(path, what, seconds)
    _MEMORY[key] = seconds
    return seconds


def _agreed(seconds: tuple[float, ...] | None) -> tuple[float, ...] | None:
    """Process 0's `seconds` in every process (None stays None); as given with one process."""
    import jax

    if jax.process_count() == 1:
        return seconds
    import numpy as np
    from jax.experimental import multihost_utils

    # the other processes may not know how many figures process 0 holds: its count goes first
    n = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if seconds is None else len(seconds))))
    if n < 0:
        return None
    mine = np.zeros((n,), np.float32) if seconds is None else np.asarray(seconds, np.float32)
    return tuple(float(x) for x in multihost_utils.broadcast_one_to_all(mine))


_CACHE_LEN = 256  # the draft step's cache, half full
_PROMPT = 128  # the rounds' prompt length
_ROUNDS = 3  # rounds per timed call


def _round_seconds(engine, batch: int, widths) -> tuple[float, ...]:
    """Seconds of one round of the engine's adaptive loop at each compiled width: `_ROUNDS` rounds
    per call (`loop.Program.rounds`), the width forced by making every other width cost 1e30, from
    the state after a prompt of up to `_PROMPT` ids; the fastest of 5 calls after a warm-up, per
    width. One program serves every width (the costs are its input); within a width the state goes
    on from call to call, its cache donated, as the while_loop updates it in place."""
    import copy

    import jax
    import numpy as np

    reps = 5
    room = (reps + 1) * _ROUNDS * (engine.k + 1)  # tokens a width's calls can emit at most
    V = engine.target.config.vocab_size
    prompt = [(7919 * i + 13) % V for i in range(_PROMPT)]
    # the same engine with room for every call's tokens and no end-of-sequence ids (no row may
    # finish while timed): its own _prepare makes every input agree with the longer cache
    timed = copy.copy(engine)
    timed.max_new_tokens, timed.max_len, timed.eos_ids = room, None, ()
    program, args = timed._prepare([prompt] * batch, measure=False)
    out = []
    for i in range(len(widths)):
        verify_W = np.full((len(widths),), 1e30, np.float32)
        verify_W[i] = 1.0
        costs = {"verify_W": verify_W, "draft_step": np.float32(0.0)}
        if engine.layout is not None:
            costs = jax.device_put(costs, engine.layout.replicated)
        state = program.start(**args)

        def call():
            nonlocal state
            state = program.rounds(args["params"], costs, state, _ROUNDS)
            return state.cache.lengths

        out.append(_time(call, reps) / _ROUNDS)
    return tuple(out)


def _draft_seconds(engine, batch: int) -> float:
    """One draft step: the draft model's forward over one token (`Drafter.truncated` drafters are
    model drafters: `ModelDrafter`, or `MultiLevel` whose `.model` is one)."""
    import jax
    import jax.numpy as jnp

    from specjax.models import llama

    model = getattr(engine.drafter, "model", engine.drafter)
    cache = llama.init_cache(model.config, batch, _CACHE_LEN, model.dtype)
    cache = cache._replace(lengths=jnp.full((batch,), _CACHE_LEN // 2, jnp.int32))
    tokens = jnp.ones((batch, 1), jnp.int32)
    fn = jax.jit(lambda p, c: llama.forward_cached(model.config, p, tokens, c, dtype=model.dtype,
                                                   backend=engine.backend)[0])
    return _time(lambda: fn(engine.params.draft, cache))


def _time(call, reps: int = 7) -> float:
    """The fastest of `reps` calls after a warm-up (the least disturbed by other work)."""
    import jax

    jax.block_until_ready(call())  # compile and warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t)
    return max(min(times), 1e-9)


def _directory():
    from specjax.models import presets

    return presets.cache_dir() / "costs"


def _read(path) -> tuple[float, ...] | None:
    """The seconds stored at `path`, or None (absent; damaged: warned, measured again)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        doc = json.loads(raw)
        body = json.dumps(doc["entry"], sort_keys=True)
        if doc.get("format") != _FORMAT or doc.get("sha256") != hashlib.sha256(body.encode()).hexdigest():
            raise ValueError("checksum or format mismatch")
        stored = doc["entry"]["seconds"]
        if not isinstance(stored, list) or not stored:
            raise ValueError("no figures")
        return tuple(_seconds("stored", x, positive=True) for x in stored)
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"{path}: damaged cost measurement ({e}); measuring again", stacklevel=3)
        return None


def _write(path, what: str, seconds: tuple[float, ...]) -> None:
    from specjax import _files

    entry = {"what": what, "seconds": list(seconds), "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d")}
    doc = {"format": _FORMAT, "entry": entry,
           "sha256": hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()}
    try:
        os.makedirs(path.parent, exist_ok=True)
        _files.atomic_write_bytes(path, json.dumps(doc, indent=1).encode())
    except OSError as e:  # a cache is optional
        warnings.warn(f"{path}: cannot keep a measured cost ({e}); measuring again next process", stacklevel=3)
