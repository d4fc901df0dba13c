r"""Generates text with specjax and prints it with its statistics.

    python experiments/generate.py                          # SmolLM2 edits a paragraph; pld + FLy beside target-only
    python experiments/generate.py --prompt "Write a quicksort in Python." --max_new_tokens 200
    python experiments/generate.py --draft none             # target-only decoding alone
    python experiments/generate.py --draft pld --method asd --budget 4
    python experiments/generate.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --method csd --csd_memory /tmp/csd_memory
    python experiments/generate.py --model path/to/model.gguf --prompts_file prompts.txt --batch_size 4

Prompts run `--batch_size` at a time (default one by one): each text is printed as
its batch finishes, with a progress line on stderr; a batch is one compiled program,
so while it runs only its elapsed time is shown. Compilation is done (and timed)
before generating; compiled programs are kept on disk, so a second run with the same
shapes starts at once. With a draft, target-only decoding runs on the same prompts
too (--compare) and its tokens/s are printed beside the method's. Rule options
(--theta, --budget, ...) are passed only when set.

The default request is an edit (fix the spelling in a paragraph given in the prompt): the reply
reuses much of its input, which is where prompt lookup pays, and the kind of request
speculation is for (editing, refactoring, summarizing code or documents). On a free chat
question the lookup rarely finds anything to copy; there a fixed K pays for drafts that are
rarely kept, and the adaptive loop narrows to plain steps: 1.05x target-only on one such question
(tau 1.09), where the edit gets 1.21-1.33x (tau 2.05, four runs on a 2-core Xeon, 2026-12-05).
"""

from __future__ import annotations

import json
import statistics

from absl import app, flags, logging

from specjax import models, verify

from experiments import _common as C, _paths  # python -m experiments.generate
_MODEL = flags.DEFINE_string("model", models.DEFAULT_PRESET,
                             f"Target: a preset ({', '.join(models.PRESETS)}), a .gguf file, a Hugging Face "
                             f"directory, or {C.RANDOM}[:SEED] (a tiny random model, for tests).")
_DRAFT = flags.DEFINE_string("draft", "pld", "Drafter: none (target-only decoding) | pld (prompt lookup) | "
                             "self:N (the target's first N layers) | a model like --model | pld+<model> "
                             "(FLy's multi-level drafting).")
_METHOD = flags.DEFINE_enum("method", "fly", list(verify.METHODS),
                            "Verification rule (greedy = exact); loose rules need a draft.")
_COMPARE = flags.DEFINE_boolean("compare", True, "With a draft, also run target-only decoding on the same prompts "
                                "and print both speeds (each program compiled before anything is timed).")
_K = flags.DEFINE_integer("k", 8, "Draft tokens per round (the most, with --adaptive).")
_ADAPTIVE = flags.DEFINE_boolean("adaptive", True, "Choose the verified width each round from what a round "
                                 "costs here (Engine(adaptive=...)); --noadaptive: always K.")
_REPEATS = flags.DEFINE_integer("timing_repeats", 3, "With --compare: the method and target-only each run this "
                                "many times, alternating, and their median times are compared (a shared "
                                "machine's speed wanders from one run to the next).")
C.define_prompt_flags(dataset=None, num_prompts=None, prompt=True)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "New tokens per prompt (EOS may stop earlier).")
_IGNORE_EOS = flags.DEFINE_boolean("ignore_eos", False, "Generate exactly --max_new_tokens (as benchmarks do).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples (lossless rules only).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (target-only decoding, temperature > 0).")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Prompts per generate call.")
_PLD_MATCH = flags.DEFINE_enum("pld_match", "earliest", ["earliest", "latest"],
                               "Which earlier occurrence prompt lookup continues.")
_MATMUL = flags.DEFINE_enum("matmul", "auto", ["auto", "native", "q8", "xla"],
                            "Matmul path (Engine(matmul=...)): auto/native keep the float32 model's logits; q8 "
                            "rounds activations to int8 as llama.cpp does (faster on CPUs with AVX512-VNNI, other "
                            "tokens at near-ties).")
_OUTPUT = flags.DEFINE_string("output", None, "Write prompts, texts, tokens and statistics to this JSON file.")
_QUIET = flags.DEFINE_boolean("quiet", False, "No progress lines on stderr.")
C.define_rule_flags()
C.define_calibration_flags()
for _module in C.FLAG_MODULES:  # --help lists the shared flags
    flags.adopt_module_key_flags(_module)

# An edit of text given in the prompt (not a request to repeat it): the reply copies most of it.
DEFAULT_PROMPTS = ["Fix the spelling mistakes in this paragraph:\n\n"
                   "Speculative decoding lets a small draft model propose several tokens, wich the large target "
                   "model then checks in a single forward pass. When the draft is right, many tokens are acepted "
                   "at once, so the output is produced faster while staying exactly the same as the target's own. "
                   "The speedup depends on how often the draft agrees with the target and on how much a wider "
                   "verification costs."]
DEFAULT_NOTE = ("the default request edits a paragraph given in the prompt, so the reply reuses much of it: "
                "where prompt lookup pays. On a free chat question (--prompt \"...\") it rarely finds anything "
                "to copy: the adaptive loop then narrows to plain steps, yet speculation can still lose a little.")


def _validate() -> None:
    for name, value in (("k", _K.value), ("max_new_tokens", _MAX_NEW.value), ("batch_size", _BATCH.value),
                        ("timing_repeats", _REPEATS.value)):
        if value <= 0:
            raise app.UsageError(f"--{name} must be positive, got {value}")
    if flags.FLAGS.num_prompts is not None and flags.FLAGS.num_prompts <= 0:
        raise app.UsageError(f"--num_prompts must be positive, got {flags.FLAGS.num_prompts}")
    if flags.FLAGS.prompt_offset < 0:
        raise app.UsageError(f"--prompt_offset must be >= 0, got {flags.FLAGS.prompt_offset}")
    if flags.FLAGS.csd_memory and _METHOD.value != "csd":
        raise app.UsageError(f"--csd_memory is for --method csd, not {_METHOD.value}")
    if flags.FLAGS.asd_calibration and _METHOD.value != "asd":
        raise app.UsageError(f"--asd_calibration is for --method asd, not {_METHOD.value}")
    if _DRAFT.value.lower() == "none" and (_METHOD.value not in ("greedy", "exact", "fly")
                                            or C.rule_options_from_flags()
                                            or (_METHOD.value == "fly" and flags.FLAGS["method"].present)):
        raise app.UsageError(f"--method {_METHOD.value} and rule options need a --draft "
                             "(pld, self:N, a model, or pld+<model>); --draft none is target-only decoding")


def main(argv):
    C.check_output("output", _OUTPUT.value)  # before any work
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    _paths.set_status(lambda: "the replies printed above are complete; --output is written only at the end, so "
                              "the same command starts again")
    _validate()
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    say = (lambda msg: None) if _QUIET.value else C.log
    texts = C.read_prompts(flags.FLAGS.prompt, flags.FLAGS.prompts_file, flags.FLAGS.dataset, flags.FLAGS.num_prompts, flags.FLAGS.prompt_offset)
    default = not texts
    texts = texts or DEFAULT_PROMPTS
    target = C.load_model(_MODEL.value)
    draft = C.resolve_draft(_DRAFT.value, _MODEL.value)
    method = _METHOD.value if draft is not None else "greedy"  # --draft none: target-only decoding
    options = C.apply_calibration(method, C.rule_options_from_flags(), target.config.vocab_size, _K.value)
    extra = {"eos_ids": ()} if _IGNORE_EOS.value else {}
    common = dict(temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value, matmul=_MATMUL.value, **extra)
    adapt = {"adaptive": _ADAPTIVE.value} if draft is not None else {}
    engine = C.make_engine(target, draft, method, _K.value, _MAX_NEW.value, pld_match=_PLD_MATCH.value, **common,
                           **adapt, **options)
    baseline = None
    if draft is not None and _COMPARE.value:
        baseline = C.make_engine(target, None, "greedy", _K.value, _MAX_NEW.value,
                                 **{**common, "top_p": 1.0})
    tok = target.tokenizer
    ids = C.encode(tok, texts, flags.FLAGS.chat)
    batches = C.chunks(ids, _BATCH.value)
    widths = sorted({engine.prompt_width(batch) for batch in batches})
    say(f"{len(ids)} prompt(s), {_MAX_NEW.value} new tokens each, method {method}, draft {_DRAFT.value}"
        + (f", k {_K.value}" + (" (adaptive)" if _ADAPTIVE.value else "") if draft is not None else ""))
    programs = len(widths) * (2 if baseline is not None else 1)
    say(f"compiling {programs} generation program(s): prompt width(s) {widths}"
        + (", for the method and for target-only decoding" if baseline is not None else "")
        + " (loaded from the compilation cache if compiled before) ...")

    def show(i, batch, out):
        for j, tokens in enumerate(out.tokens):
            n = i * _BATCH.value + j
            print(f"\n>>> {texts[n]}\n{tok.decode(tokens, skip_special_tokens=True)}", flush=True)

    with C.Ticker("compiling") if not _QUIET.value else C.Null():
        compile_s = C.compile_for(engine, batches)
        if baseline is not None:
            compile_s += C.compile_for(baseline, batches)
    say(f"compiled in {compile_s:.1f}s; generating ...")
    result = C.run(engine, ids, _BATCH.value, progress=not _QUIET.value, on_batch=show, warm=False)
    s = result.stats
    print(f"\n--- {len(ids)} prompt(s), {result.num_tokens} new tokens in {result.seconds:.2f}s "
          f"({result.tokens_per_s:.1f} tokens/s), method={method}, draft={_DRAFT.value}, "
          f"compile {compile_s:.1f}s")
    if baseline is not None:
        say("target-only decoding of the same prompts ...")
        base = C.run(baseline, ids, _BATCH.value, warm=False)
        times, base_times = [result.seconds], [base.seconds]
        for _ in range(_REPEATS.value - 1):  # alternating, so that a slow minute slows both
            times.append(C.run(engine, ids, _BATCH.value, warm=False).seconds)
            base_times.append(C.run(baseline, ids, _BATCH.value, warm=False).seconds)
        mine_s, base_s = statistics.median(times), statistics.median(base_times)
        runs = f", medians of {len(times)} runs each" if len(times) > 1 else ""
        print(f"target-only: {base.num_tokens} new tokens in {base_s:.2f}s ({base.num_tokens / base_s:.1f} tokens/s); "
              f"{method} with {_DRAFT.value}: {result.num_tokens / mine_s:.1f} tokens/s, "
              f"{(result.num_tokens / mine_s) / (base.num_tokens / base_s):.2f}x, tau {s['tau']:.2f}{runs}"
              + ("" if base.tokens == result.tokens else " (some outputs differ from target-only's)"))
        if default:
            print(f"({DEFAULT_NOTE})")
    for key in ("tau", "rounds", "tau_per_request", "accepted_per_round", "accepted_per_position", "loose",
                "mismatches_examined", "loose_share", "csd_memory_filled", "csd_memory_capacity",
                "csd_memory_dropped", "ledger_spent_per_request"):
        if key in s:
            value = s[key]
            if isinstance(value, float):
                value = round(value, 4)
            elif isinstance(value, list) and value and isinstance(value[0], float):
                value = [round(v, 3) for v in value]
            print(f"{key}: {value}")
    if _OUTPUT.value:
        record = {"model": _MODEL.value, "draft": _DRAFT.value, "method": method, "k": _K.value,
                  "options": {k: v for k, v in options.items() if k != "csd_memory"},
                  "csd_memory": flags.FLAGS.csd_memory, "max_new_tokens": _MAX_NEW.value,
                  "seconds": result.seconds, "compile_seconds": compile_s, "machine": C.machine(),
                  "prompts": texts, "texts": [tok.decode(t, skip_special_tokens=True) for t in result.tokens],
                  "tokens": result.tokens, "stats": s,
                  "target_only": None if baseline is None else {"seconds": base.seconds, "tokens": base.tokens,
                                                                "median_seconds": base_s,
                                                                "method_median_seconds": mine_s}}
        with C.atomic_open(_OUTPUT.value, "w", encoding="utf-8") as f:
            json.dump(C.jsonable(record), f, indent=1)
        say(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
    C.run_main(main)
