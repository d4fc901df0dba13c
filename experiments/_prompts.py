"""Prompts for the binaries: --prompt values, a --prompts_file, or a dataset (HumanEval, MT-Bench)."""

from __future__ import annotations

from typing import Sequence

from absl import app, flags

DATASETS = ("mtbench", "humaneval")


def define_prompt_flags(*, dataset: str | None, num_prompts: int | None, prompt: bool = False) -> None:
    """--prompts_file, --dataset, --num_prompts, --prompt_offset, --chat (and --prompt, repeatable)."""
    if prompt:
        flags.DEFINE_multi_string("prompt", None, "A prompt (repeat the flag for several).")
    flags.DEFINE_string("prompts_file", None, "A text file with one prompt per line"
                        + ("." if dataset is None else " (replaces --dataset)."))
    flags.DEFINE_enum("dataset", dataset, list(DATASETS), "Prompts from MT-Bench or HumanEval"
                      + (" (added to the others)." if dataset is None else " (unless --prompts_file)."))
    flags.DEFINE_integer("num_prompts", num_prompts, "Keep this many prompts (after --prompt_offset).")
    flags.DEFINE_integer("prompt_offset", 0, "Skip this many prompts first.")
    flags.DEFINE_boolean("chat", True, "Wrap each prompt in the model's chat template.")


def read_prompts(prompts: Sequence[str] | None, prompts_file: str | None, dataset: str | None,
                 num: int | None, offset: int = 0) -> list[str]:
    """--prompt values, then the lines of --prompts_file, then --dataset items [offset, offset + num)."""
    out = list(prompts or [])
    if prompts_file:
        try:
            with open(prompts_file, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise app.UsageError(f"cannot read --prompts_file: {e}") from None
        if not lines:
            raise app.UsageError(f"--prompts_file {prompts_file}: no prompts in it (empty, or blank lines only)")
        out += lines
    if dataset:
        from experiments import data

        if dataset not in DATASETS:
            raise app.UsageError(f"unknown --dataset {dataset!r} (one of {', '.join(DATASETS)})")
        try:
            items = data.messages(dataset)
        except (FileNotFoundError, ImportError) as e:
            raise app.UsageError(f"--dataset {dataset}: {e}") from None
        out += items[offset: None if num is None else offset + num]
    elif num is not None:
        out = out[offset: offset + num]
    return out


def encode(tokenizer, texts: Sequence[str], chat: bool = True) -> list[list[int]]:
    return [tokenizer.chat_prompt_ids(t) if chat else tokenizer.encode(t) for t in texts]
