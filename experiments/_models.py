"""Models and drafts from the binaries' --model / --draft specs.

Model specs: a preset name, a .gguf file, a Hugging Face directory (`specjax.models.load`), or
random:tiny[:SEED], a 2-layer random model (vocabulary 258) with a byte-level tokenizer and ChatML
tokens (fast tests, no checkpoint needed). Draft specs: none | pld | self:N | <model spec> |
pld+<model spec> | a feature-draft directory (train_draft.py --arch=feature); the Engine turns what `resolve_draft` returns into a drafter
(`specjax.drafters.from_spec`).
"""

from __future__ import annotations

import dataclasses
import functools

from absl import app

from specjax import cross_draft, drafters, models, vocab_bridge
from specjax.models import feature_draft

from experiments import _cli

RANDOM = "random:tiny"


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, then <|im_start|>, <|im_end|> = EOS) built
    with `tokenizers`: no merges, so every byte is one token."""
    from tokenizers import Tokenizer, decoders
    from tokenizers import models as tok_models
    from tokenizers import pre_tokenizers

    from specjax.models.tokenizer import Tokenizer as SpecTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(tok_models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return SpecTokenizer(backend, vocab_size=len(alphabet) + 2, bos_token_id=None,
                         eos_token_id=backend.token_to_id("<|im_end|>"))


def random_tiny(seed: int = 0) -> models.Model:
    tok = byte_tokenizer()
    config = models.Config(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                           eos_token_ids=(tok.eos_token_id,))
    m = models.random_model(config, seed=seed)
    return dataclasses.replace(m, tokenizer=tok, name=f"{RANDOM}:{seed}")


@functools.cache
def load_model(spec: str) -> models.Model:
    """A model from a spec (module docstring); errors become app.UsageError."""
    if spec == RANDOM or spec.startswith(RANDOM + ":"):
        seed = spec[len(RANDOM) + 1:] or "0"
        if not seed.isdigit():
            raise app.UsageError(f"model {spec!r}: expected {RANDOM}[:SEED] with an integer seed")
        return random_tiny(int(seed))
    if spec.startswith("random:"):
        raise app.UsageError(f"unknown random model {spec!r}; the only one is {RANDOM}[:SEED]")
    _cli.log(f"loading {spec} ...")
    try:
        m = models.load(spec)
    except (models.PresetError, FileNotFoundError, models.ConfigError) as e:
        raise app.UsageError(f"cannot load model {spec!r}: {e}") from None
    _cli.log(f"loaded {spec} in {m.load_seconds:.1f}s ({m.load_source}); {m.config.num_layers} layers, "
        f"vocab {m.config.vocab_size}")
    if m.tokenizer is None:
        raise app.UsageError(f"{spec} has no tokenizer; pass a GGUF or a directory with tokenizer.json")
    return m


def resolve_draft(spec: str | None, target_spec: str):
    """The Engine's `draft` argument of a draft spec: None, "pld", "self:N", a Model or ("pld", Model).
    A model of another family (another vocabulary) is translated inside the loop (docs/cross_vocab.md)."""
    if spec is None or spec.lower() in ("", "none"):
        return None
    if spec in ("pld",) or spec.startswith("self:"):
        if spec.startswith("self:") and not spec[5:].isdigit():
            raise app.UsageError(f"--draft {spec!r}: expected self:N with an integer N")
        return spec
    if spec.startswith("pld+"):
        rest = spec[4:]
        return ("pld", feature_draft.load(rest) if feature_draft.is_feature_draft(rest) else load_model(rest))
    if feature_draft.is_feature_draft(spec):  # a directory made by train_draft.py --arch=feature
        return feature_draft.load(spec)
    return load_model(spec)


def draft_model(spec: str | None, target: models.Model) -> models.Model:
    """A draft model for calibration: a model spec or self:N (one of another vocabulary is driven
    through its exact rounds instead of teacher-forced: experiments/_rounds.py)."""
    if spec is None or spec.lower() in ("", "none", "pld") or spec.startswith("pld+"):
        raise app.UsageError(f"--draft {spec!r}: calibration needs a draft model (a preset, a checkpoint, "
                             f"{RANDOM}[:SEED] or self:N), not prompt lookup")
    if spec.startswith("self:"):
        try:
            return drafters.self_draft_model(target, spec[5:])
        except ValueError as e:
            raise app.UsageError(f"--draft {spec!r}: {e}") from None
    draft = load_model(spec)
    try:
        if cross_draft.same_vocab(target, draft):
            drafters.check_vocab(target, draft)
        else:  # another vocabulary: its rounds are run, translated (experiments/_rounds.py)
            vocab_bridge.check_bridgeable(target.tokenizer, draft.tokenizer, target_name=target.name or "the target",
                                          draft_name=draft.name or spec)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    return draft
