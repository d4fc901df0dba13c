r"""Generates text with specjax and prints it with its statistics.

    python experiments/generate.py                          # SmolLM2 default, a built-in prompt
    python experiments/generate.py --prompt "Write a quicksort in Python." --max_new_tokens 200
    python experiments/generate.py --model path/to/model.gguf --prompts_file prompts.txt
"""

from __future__ import annotations

import sys
import time

from absl import app, flags, logging

import specjax
from specjax import models

_MODEL = flags.DEFINE_string("model", models.DEFAULT_PRESET, "Preset name, .gguf file or HF model directory.")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "A prompt (repeat the flag for a batch).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "A text file with one prompt per line.")
_CHAT = flags.DEFINE_boolean("chat", True, "Wrap each prompt in the model's chat template.")
_METHOD = flags.DEFINE_string("method", "greedy", "Verification method (greedy = exact).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "New tokens per prompt (EOS may stop earlier).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (with --temperature > 0).")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_K = flags.DEFINE_integer("k", 8, "Draft tokens per round.")

DEFAULT_PROMPTS = ["Write a Python function that checks whether a string is a palindrome."]


def _log(msg: str) -> None:
    print(f"[specjax] {msg}", file=sys.stderr, flush=True)


def read_prompts() -> list[str]:
    prompts = list(_PROMPT.value or [])
    if _PROMPTS_FILE.value:
        with open(_PROMPTS_FILE.value, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts or DEFAULT_PROMPTS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if _MAX_NEW.value <= 0:
        raise app.UsageError(f"--max_new_tokens must be positive, got {_MAX_NEW.value}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    prompts = read_prompts()
    _log(f"loading {_MODEL.value} ...")
    model = models.load(_MODEL.value)
    _log(f"loaded in {model.load_seconds:.1f}s ({model.load_source}); "
         f"{model.config.num_layers} layers, vocab {model.config.vocab_size}")
    if model.tokenizer is None:
        raise app.UsageError(f"{_MODEL.value} has no tokenizer; pass a GGUF or a directory with tokenizer.json")
    tok = model.tokenizer
    ids = [tok.chat_prompt_ids(p) if _CHAT.value else tok.encode(p) for p in prompts]
    engine = specjax.Engine(model, method=_METHOD.value, k=_K.value, max_new_tokens=_MAX_NEW.value,
                            temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value)
    _log(f"compiling the generation program (batch {len(ids)}, {_MAX_NEW.value} new tokens) ...")
    start = time.perf_counter()
    engine.lower(ids).compile()
    _log(f"compiled in {time.perf_counter() - start:.1f}s; generating ...")
    start = time.perf_counter()
    out = engine.generate(ids)
    seconds = time.perf_counter() - start
    total = sum(len(t) for t in out.tokens)
    for prompt, tokens in zip(prompts, out.tokens):
        print(f"\n>>> {prompt}\n{tok.decode(tokens, skip_special_tokens=True)}")
    print(f"\n--- {len(prompts)} prompt(s), {total} new tokens in {seconds:.2f}s "
          f"({total / seconds:.1f} tokens/s), method={_METHOD.value}")
    for key in ("tau", "rounds", "tau_per_request"):
        print(f"{key}: {out.stats[key]}")


if __name__ == "__main__":
    app.run(main)
