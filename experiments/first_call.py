r"""What a new process waits for before it generates: compilation, or loading compiled programs.

Runs the same workload in two fresh processes that share one (initially empty) compilation
cache directory: the first compiles and fills the cache, the second should load every
program from it. In each process, every engine's first `generate` on each prompt is timed,
then the same call again (already compiled: the generation itself); the difference is what
the first call spent before generating. Also prints how many programs (prompt widths) a
process serving prompts of many lengths compiles.

    python experiments/first_call.py                        # SmolLM2, 8 HumanEval prompts, target-only + FLy/pld
    python experiments/first_call.py --num_prompts 4 --engines target
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

from experiments import _paths

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf or HF directory.")
_NUM = flags.DEFINE_integer("num_prompts", 8, "HumanEval prompts (raw completion), the first N.")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt (EOS ignored).")
_ENGINES = flags.DEFINE_multi_enum("engines", ["target", "fly"], ["target", "fly"],
                                   "target: target-only decoding; fly: FLy with prompt lookup (k=8).")
_CACHE = flags.DEFINE_string("cache_dir", "", "Compilation cache directory shared by the two processes "
                             "(default: a new temporary directory, so the first process starts cold).")
_LENGTHS = flags.DEFINE_list("ladder_lengths", [], "Prompt lengths for the program count (default: 16 "
                             "lengths evenly spaced over 20..400).")
_CHILD = flags.DEFINE_boolean("child", False, "Internal: run the workload in this process and print JSON.")


def child() -> dict:
    started = time.perf_counter()
    import specjax
    from specjax import models
    from experiments import data

    m = models.load(_MODEL.value)
    loaded = time.perf_counter()
    prompts = [m.tokenizer.encode(p["prompt"]) for p in data.humaneval_problems(_NUM.value)]
    engines = {}
    if "target" in _ENGINES.value:
        engines["target-only"] = specjax.Engine(m, max_new_tokens=_NEW.value, eos_ids=())
    if "fly" in _ENGINES.value:
        engines["fly+pld"] = specjax.Engine(m, draft="pld", method="fly", k=8, max_new_tokens=_NEW.value, eos_ids=())
    rows = []
    for name, engine in engines.items():
        seen = set()
        for ids in prompts:
            t = time.perf_counter()
            engine.generate([ids])
            first = time.perf_counter() - t
            t = time.perf_counter()
            engine.generate([ids])
            again = time.perf_counter() - t
            width = engine.prompt_width([ids])
            rows.append(dict(engine=name, length=len(ids), width=width, new_width=width not in seen,
                             first_s=first, again_s=again))
            seen.add(width)
    return dict(import_and_load_s=loaded - started, load_source=m.load_source, rows=rows,
                total_s=time.perf_counter() - started)


def main(argv):
    del argv
    if _CHILD.value:
        print("RESULT " + json.dumps(child()))
        return
    _paths.check_output("cache_dir", _CACHE.value, dir=True)  # before any work
    from specjax import engine as engine_lib

    lengths = [int(x) for x in _LENGTHS.value] or [round(20 + i * (400 - 20) / 15) for i in range(16)]
    widths = sorted({engine_lib.prompt_width(n) for n in lengths})
    print(f"program count: {len(lengths)} prompts of lengths {lengths} -> {len(widths)} prompt widths "
          f"{widths} (geometric ladder) = {len(widths)} programs per engine; with a bucket of 64: "
          f"{len({engine_lib.prompt_width(n, 64) for n in lengths})}")
    cache = _CACHE.value or tempfile.mkdtemp(prefix="specjax-xla-")
    env = {**os.environ, "SPECJAX_COMPILATION_CACHE": cache}
    args = [sys.executable, os.path.abspath(__file__), "--child", f"--model={_MODEL.value}",
            f"--num_prompts={_NUM.value}", f"--max_new_tokens={_NEW.value}",
            *[f"--engines={e}" for e in _ENGINES.value]]
    print(f"compilation cache: {cache}; load averages {os.getloadavg()}")
    for process in ("first process (empty cache)", "second process (same shapes)"):
        out = subprocess.run(args, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"child failed:\n{out.stderr[-3000:]}")
        result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
        files = sum(len(f) for _, _, f in os.walk(cache))
        print(f"\n{process}: import + model load {result['import_and_load_s']:.1f}s "
              f"({result['load_source']}); process total {result['total_s']:.1f}s; cache files now {files}; "
              f"load averages {os.getloadavg()}")
        print("| engine | prompts | new widths | first calls (s) | same calls again (s) | spent before generating (s) |")
        print("|---|---|---|---|---|---|")
        for name in dict.fromkeys(r["engine"] for r in result["rows"]):
            rs = [r for r in result["rows"] if r["engine"] == name]
            first, again = sum(r["first_s"] for r in rs), sum(r["again_s"] for r in rs)
            print(f"| {name} | {len(rs)} | {sum(r['new_width'] for r in rs)} | {first:.1f} | {again:.1f} "
                  f"| {first - again:.1f} |")


if __name__ == "__main__":
    _paths.run(main)
