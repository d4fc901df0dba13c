r"""How long `models.load` takes, with the converted cache cold (emptied) and warm.

Each measurement is a fresh process (what a user's script waits for): cold runs each get a new
empty $SPECJAX_CACHE (so the preset's checksum, the GGUF's conversion and the cache's write are
all in it); warm runs share one cache that a first, unmeasured load filled. Reported: the
median over `--repeats` of `Model.load_seconds` (the `load` call alone) and of the process's
imports (jax and specjax, paid once per process whatever the cache), and the load's CPU time
(all threads: what it costs whatever else the machine runs, where wall time also waits for a core).

`--baseline DIR`, another checkout of specjax (`mkdir DIR && git archive main | tar -x -C DIR`),
runs its loads too, alternating with this tree's process by process (a busy machine's load then
falls on both alike), each tree with its own caches; the table gets one row per tree and mode.
With warm, this tree's warm load is also timed part by part (`--nosplit`: not).

    python experiments/bench_load.py                           # SmolLM2, cold and warm, 5 each
    python experiments/bench_load.py --modes warm --repeats 9
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from experiments import _paths

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf or HF directory.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Fresh processes per mode (the median is reported).")
_MODES = flags.DEFINE_multi_enum("modes", ["cold", "warm"], ["cold", "warm"],
                                 "cold: an empty cache per process; warm: a cache filled beforehand.")
_BASELINE = flags.DEFINE_string("baseline", None, "Another specjax checkout to time alternately with this one.")
_SPLIT = flags.DEFINE_boolean("split", True, "With warm: also time the warm load's parts one after another "
                              "(this tree; fresh processes), as CPU time.")
_CHILD = flags.DEFINE_boolean("child", False, "Internal: load once in this process and print JSON.")
_CHILD_SPLIT = flags.DEFINE_boolean("child_split", False, "Internal: time a warm load's parts and print JSON.")
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child() -> dict:
    started = time.perf_counter()
    import jax

    from specjax import models

    imported, cpu = time.perf_counter(), time.process_time()
    m = models.load(_MODEL.value)
    jax.block_until_ready(m.params)
    return dict(import_s=imported - started, load_s=m.load_seconds, load_source=m.load_source,
                until_ready_s=time.perf_counter() - imported, load_cpu_s=time.process_time() - cpu)


def child_split() -> dict:
    """CPU seconds of each part of a warm load, run one after another (the load overlaps the
    weights' read with the rest): the files' check and read, the tokenizer, the device's start,
    the placement."""
    import pathlib

    import jax

    from specjax.models import _param_cache, presets
    from specjax.models import model as m

    src = _MODEL.value  # its cache entry, found as `models.load` finds it
    path = presets.resolve(src) if src in presets.PRESETS else pathlib.Path(src)
    key = (f"{src}-{presets.PRESETS[src].sha256[:16]}" if src in presets.PRESETS
           else m._source_key(path, path.is_file()))
    entry = m._cache_dir(key, path.is_file(), True)
    out, cpu = {}, time.process_time()

    def lap(name):
        nonlocal cpu
        now = time.process_time()
        out[name] = now - cpu
        cpu = now

    meta, flat = _param_cache.read(entry, (m._CONFIG, m._QUANTIZED, m._TOKENIZER))
    lap("read_and_check_s")
    from specjax.models import tokenizer

    tokenizer.Tokenizer.from_state(json.loads(meta[m._TOKENIZER]))
    lap("tokenizer_s")
    jax.devices()
    lap("device_start_s")
    jax.block_until_ready(jax.device_put(flat))
    lap("device_put_s")
    return out


def _measure(cache: str, tree: str = _HERE, child: str = "load") -> dict:
    """One fresh process loading with `tree`'s specjax (its own bench_load.py's child)."""
    args = [sys.executable, "-m", "experiments.bench_load", "--child" if child == "load" else "--child_split",
            f"--model={_MODEL.value}"]
    env = {**os.environ, "SPECJAX_CACHE": cache, "PYTHONPATH": tree}
    out = subprocess.run(args, env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise _paths.RunError(f"the loading process failed:\n{out.stderr[-3000:]}")
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main(argv):
    del argv
    if _CHILD.value or _CHILD_SPLIT.value:
        print("RESULT " + json.dumps(child() if _CHILD.value else child_split()))
        return
    from experiments import _cli  # here: the measured children import only what they time

    if _REPEATS.value < 1:
        raise _paths.RunError(f"--repeats must be >= 1, got {_REPEATS.value}")
    trees = {"this": _HERE}
    if _BASELINE.value:
        if not os.path.isfile(os.path.join(_BASELINE.value, "experiments", "bench_load.py")):
            raise _paths.RunError(f"--baseline {_BASELINE.value!r} is not a specjax checkout")
        trees["baseline"] = os.path.abspath(_BASELINE.value)
    root = tempfile.mkdtemp(prefix="specjax-bench-load-")
    rows = []
    try:
        for mode in _MODES.value:
            runs = {t: [] for t in trees}
            if mode == "warm":
                for t, tree in trees.items():
                    _measure(os.path.join(root, f"warm-{t}"), tree)  # fills the cache
            for i in range(_REPEATS.value):
                for t, tree in (trees.items() if i % 2 == 0 else reversed(trees.items())):  # alternating
                    cache = os.path.join(root, f"warm-{t}" if mode == "warm" else f"cold{i}-{t}")
                    runs[t].append(_measure(cache, tree))
                    if mode == "cold":
                        shutil.rmtree(cache, ignore_errors=True)
            if mode == "warm" and _SPLIT.value:
                parts = [_measure(os.path.join(root, "warm-this"), child="split") for _ in range(_REPEATS.value)]
                split = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
            for t, tree_runs in runs.items():
                rows.append(dict(tree=t, mode=mode, source="/".join(sorted({r["load_source"] for r in tree_runs})),
                                 load_s=statistics.median(r["load_s"] for r in tree_runs),
                                 load_all_s=[round(r["load_s"], 3) for r in tree_runs],
                                 import_s=statistics.median(r["import_s"] for r in tree_runs),
                                 cpu_s=statistics.median(r["load_cpu_s"] for r in tree_runs)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"models.load({_MODEL.value!r}), fresh process each, medians of {_REPEATS.value}; "
          f"{_cli.machine()}; {datetime.date.today()}; load averages {os.getloadavg()}"
          + (f"; baseline {trees['baseline']}, alternating with this tree" if _BASELINE.value else ""))
    print("| tree | cache | served from | load, wall (s) | each run (s) | load, CPU time of all threads (s) "
          "| imports before it, wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tree']} | {r['mode']} | {r['source']} | {r['load_s']:.2f} | {r['load_all_s']} | {r['cpu_s']:.2f} "
              f"| {r['import_s']:.2f} |")
    if "warm" in _MODES.value and _SPLIT.value:
        print("This tree's warm load, CPU time of its parts one after another (medians): "
              + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.3f} s" for k, v in split.items()))
    print("(CPU time is the load's work whatever else the machine runs; wall time waits for a core too.)")


if __name__ == "__main__":
    _paths.run(main)
