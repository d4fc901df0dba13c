r"""Fixed draft lengths against the adaptive loop: tokens/s over target-only, per prompt, interleaved.

Rows: each rule (exact, FLy's defaults, FLy's published rule) with each drafter (prompt lookup,
a draft model) at fixed K (`Engine(adaptive=False)`) and adaptive at the largest K. Per prompt,
target-only runs first, then every row on the same prompt. Each measurement is a line of
OUTPUT_DIR/measurements.jsonl, written as it is made: a rerun with the same flags skips what is
done (hours of measurement survive a kill). The table (printed, and OUTPUT_DIR/table.md) gives
per row the median over prompts of the tokens/s ratio, tau, the best fixed K of its (rule,
drafter), and whether adaptive is within 5% of it and >= 1.0x; then the cost of a round with
nothing proposed in target steps, and the widths the policy would choose under the H200 cost
profile (experiments/results/device_h200_engine.md).

    python experiments/benchmark_adaptive.py --output_dir /tmp/adaptive          # Qwen 1.5B + 0.5B draft, 8+8 prompts
    python experiments/benchmark_adaptive.py --quick --output_dir /tmp/adaptive_q # SmolLM2 with prompt lookup
    python experiments/benchmark_adaptive.py --quick --noadaptive --num_humaneval 4 --num_mtbench 4 --output_dir /tmp/adaptive_q4
"""

from __future__ import annotations

import datetime
import os

from absl import flags, logging

from experiments import _adaptive_bench as B
from experiments import _cli, _jsonl, _models, _paths

_MODEL = flags.DEFINE_string("model", "qwen2.5-coder-1.5b-instruct", "Target (preset, .gguf, HF directory, "
                             f"{_models.RANDOM}[:SEED]).")
_DRAFT_MODEL = flags.DEFINE_string("draft_model", "qwen2.5-coder-0.5b-instruct", "The model drafter's rows.")
_DRAFTS = flags.DEFINE_list("drafts", ["pld", "model"], "Drafters: pld and/or model (--draft_model).")
_METHODS = flags.DEFINE_list("methods", ["exact", "fly", B.PUBLISHED_FLY.replace(",", ";")],
                             "Method specs (';' between a spec's options, as in "
                             f"{B.PUBLISHED_FLY.replace(',', ';')}).")
_KS = flags.DEFINE_list("ks", ["2", "4", "8", "15"], "Fixed draft lengths; the adaptive rows use the largest.")
_ADAPTIVE = flags.DEFINE_boolean("adaptive", True, "Also run the adaptive loop (needs a specjax that has it).")
_QUICK = flags.DEFINE_boolean("quick", False, "SmolLM2 with prompt lookup only (sets --model and --drafts).")
_NUM_HE = flags.DEFINE_integer("num_humaneval", 8, "HumanEval chat requests (the first N).")
_NUM_MT = flags.DEFINE_integer("num_mtbench", 8, "MT-Bench first turns (the first N).")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt (EOS ignored, as benchmarks do).")
_EMPTY = flags.DEFINE_boolean("empty_round", True, "Measure the cost of a round with nothing proposed.")
_OUT = flags.DEFINE_string("output_dir", None, "Where measurements.jsonl (resumed) and table.md go.")
_MEASURE = flags.DEFINE_boolean("measure", True, "--nomeasure: only the table of what the ledger holds (while "
                                "another process is still measuring into it, say).")
flags.mark_flag_as_required("output_dir")


def main(argv):
    if len(argv) > 1:
        raise _paths.RunError(f"unexpected arguments: {' '.join(argv[1:])}")
    _paths.check_output("output_dir", _OUT.value, dir=True)
    logging.set_verbosity(logging.WARNING)
    model = "smollm2-135m-instruct" if _QUICK.value and not flags.FLAGS["model"].present else _MODEL.value
    drafts = ["pld"] if _QUICK.value and not flags.FLAGS["drafts"].present else _DRAFTS.value
    try:
        ks = sorted({int(k) for k in _KS.value})
    except ValueError:
        raise _paths.RunError(f"--ks must be integers, got {_KS.value}") from None
    if not ks or ks[0] < 1:
        raise _paths.RunError(f"--ks must be integers >= 1, got {_KS.value}")
    if set(drafts) - {"pld", "model"} or not drafts:
        raise _paths.RunError(f"--drafts must be pld and/or model, got {drafts}")
    methods = [m.replace(";", ",") for m in _METHODS.value]
    if _ADAPTIVE.value and not B.has_adaptive():
        raise _paths.RunError("this specjax's Engine has no adaptive loop (adaptive=); pass --noadaptive")
    for name in ("num_humaneval", "num_mtbench", "max_new_tokens"):
        if flags.FLAGS[name].value < (1 if name == "max_new_tokens" else 0):
            raise _paths.RunError(f"--{name} is out of range: {flags.FLAGS[name].value}")

    names = ["pld" if d == "pld" else _DRAFT_MODEL.value for d in drafts]
    all_rows = B.rows(methods, names, ks, _ADAPTIVE.value)
    items = B.prompts(_NUM_HE.value, _NUM_MT.value)
    os.makedirs(_OUT.value, exist_ok=True)
    ledger = _jsonl.Ledger(os.path.join(_OUT.value, "measurements.jsonl"), B.key, read_only=not _MEASURE.value)
    target = None
    if _MEASURE.value:
        target = _models.load_model(model)
        draft_models = {"pld": "pld"}
        if "model" in drafts:
            draft_models[_DRAFT_MODEL.value] = _models.draft_model(_DRAFT_MODEL.value, target)
        settings = dict(model=model, max_new_tokens=_NEW.value, machine=_cli.machine())
        runner = B.Runner(target, draft_models, _NEW.value, ledger, settings, log=_cli.log)
        _cli.log(f"{len(items)} prompts x {len(all_rows) + 1} configurations; {len(ledger)} measured before")
        _paths.set_status(lambda: f"{len(ledger)} measurements in {ledger.path}; the same command resumes")
        runner.run(items, all_rows)
        ledger.close()
    lines = [l for l in ledger.lines.values() if l.get("model") == model and l.get("max_new_tokens") == _NEW.value]

    def h200(k, model_draft):
        return B.h200_costs(model, k, model_draft)

    where = lines[0]["machine"] if lines else _cli.machine()  # the machine and dates of the measurements
    dates = sorted({l["date"] for l in lines}) or [datetime.date.today().isoformat()]
    parts = [f"# Fixed K against the adaptive loop: {model}, {_NEW.value} new tokens, batch 1",
             "", f"{where}; {' to '.join(dict.fromkeys([dates[0], dates[-1]]))}. "
             "Medians over prompts of each prompt's tokens/s "
             "over target-only's on the same prompt (interleaved per prompt). The last column: the width the "
             "adaptive policy would choose from the row's measured acceptance under a cost table computed "
             f"from the H200 profile ({B.H200_PROFILE.name}, batch 1), with its expected speedup there."]
    for title, keep in (("all prompts", None), ("HumanEval", "humaneval"), ("MT-Bench", "mtbench")):
        chosen = [l for l in lines if keep is None or l["dataset"] == keep]
        if not chosen:
            continue
        parts += ["", f"## {title}", "", B.table(B.summarize(chosen, all_rows), h200, [_DRAFT_MODEL.value])]
    if _EMPTY.value and items and target is not None:
        empty = B.empty_round_cost(target, target.tokenizer.chat_prompt_ids(items[0][2]), ks[-1], _NEW.value)
        parts += ["", "## A round with nothing proposed", ""]
        parts.append("not measured: this specjax has no adaptive loop" if empty is None else
                     f"{empty['steps']:.3f} target steps (prompt lookup, exact, K={empty['k']}, "
                     "every round at width 1; "
                     f"{empty['lone_s']:.3f}s against target-only's {empty['base_s']:.3f}s for {empty['tokens']} "
                     f"tokens, medians of {empty['repeats']})")
    costs = h200(ks[-1], False)
    if costs is not None:
        parts += ["", f"H200 cost table (K={ks[-1]}, {costs.source}): verify in target steps "
                  + ", ".join(f"w{w}={v / costs.verify_s[0]:.2f}" for w, v in enumerate(costs.verify_s, 1))]
    text = "\n".join(parts) + "\n"
    _paths.write_text(os.path.join(_OUT.value, "table.md"), text)
    print(text)


if __name__ == "__main__":
    _paths.run(main)
