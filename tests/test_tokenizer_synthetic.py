"""Tokenizer on small synthetic vocabularies (no checkpoint needed): round trips for every
pre-tokenizer, bos and chat templates, Hugging Face directories, and the errors."""

from __future__ import annotations

import json
import unicodedata

import pytest

gguf = pytest.importorskip("gguf")

from _tokenizer_corpus import _TOKENS, _TYPES, CORPUS, NOT_NFC, SMOLLM_SYSTEM, _write_gguf  # noqa: E402

from specjax.models import tokenizer as tokenizer_lib  # noqa: E402
from specjax.models.tokenizer import Tokenizer  # noqa: E402


@pytest.mark.parametrize("pre", sorted(tokenizer_lib._PRE_TOKENIZERS))
def test_tiny_round_trip(pre, tmp_path):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", pre=pre))
    assert tok.vocab_size == len(_TOKENS) and tok.eos_token_id == 2 and tok.bos_token_id is None
    the, hell = tok.token_to_id("Ġthe"), tok.token_to_id("hell")
    assert tok.encode("hello the") == [hell, tok.token_to_id("o"), the]
    assert tok.encode("<|im_start|>he<|im_end|>") == [1, tok.token_to_id("he"), 2]
    for text in CORPUS + NOT_NFC:
        expected = unicodedata.normalize("NFC", text) if pre in ("qwen2", "deepseek-r1-qwen") else text
        assert tok.decode(tok.encode(text)) == expected


def test_tiny_add_bos(tmp_path):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", bos=1, add_bos=True))
    assert tok.encode("he", add_special_tokens=True) == [1, tok.token_to_id("he")]
    assert tok.encode("he") == [tok.token_to_id("he")]


def test_tiny_chat_template_and_fallback(tmp_path):
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}")
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", template=template))
    msgs = [{"role": "user", "content": "a<b>\"é\""}]
    assert tok.apply_chat_template(msgs) == '[user]"a<b>\\"é\\""\n[assistant]<|im_end|>'
    tok.chat_template = None  # ChatML, with SmolLM2's default system prompt for "smollm"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n<|im_start|>user\na<b>\"é\"<|im_end|>\n")
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "g.gguf", pre="gpt2"))
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).startswith("<|im_start|>user\n")


def test_from_dir(tmp_path):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf"))
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    tok.backend.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_dir(hf_dir)  # ids from config.json
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.vocab_size) == (1, 2, len(_TOKENS))
    assert loaded.encode("hello the<|im_end|>") == tok.encode("hello the<|im_end|>")
    (hf_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    loaded = Tokenizer.from_dir(hf_dir)
    assert loaded.eos_token_id == 0
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def _raises(match, fn, *args, exc=ValueError, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def test_errors_gguf(tmp_path):
    _raises("GGUF file not found", Tokenizer.from_gguf, tmp_path / "missing.gguf", exc=FileNotFoundError)
    _raises("no tokenizer metadata 'tokenizer.ggml.model'", Tokenizer.from_gguf,
            _write_gguf(tmp_path / "a.gguf", model=None, tokens=None, merges=None, types=None, pre=None,
                        eos=None))
    _raises(r"unsupported tokenizer model 'llama' \(SentencePiece\)", Tokenizer.from_gguf,
            _write_gguf(tmp_path / "b.gguf", model="llama"))
    _raises("unknown pre-tokenizer 'jais-x'", Tokenizer.from_gguf,
            _write_gguf(tmp_path / "c.gguf", pre="jais-x"))
    path = _write_gguf(tmp_path / "d.gguf", pre=None)
    _raises("no 'tokenizer.ggml.pre'", Tokenizer.from_gguf, path)
    assert Tokenizer.from_gguf(path, pre="gpt2").vocab_size == len(_TOKENS)
    _raises("'tokenizer.ggml.merges'", Tokenizer.from_gguf, _write_gguf(tmp_path / "e.gguf", merges=None))
    _raises("token types for", Tokenizer.from_gguf, _write_gguf(tmp_path / "f.gguf", types=_TYPES[:-1]))
    _raises("malformed tokenizer.ggml.merges", Tokenizer.from_gguf,
            _write_gguf(tmp_path / "g.gguf", merges=["Ġ t", "hell"]))
    _raises("eos_token_id=9999 is outside", Tokenizer.from_gguf, _write_gguf(tmp_path / "h.gguf", eos=9999))
    _raises("add_bos_token is set", Tokenizer.from_gguf, _write_gguf(tmp_path / "i.gguf", add_bos=True))


def test_errors_use(tmp_path):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", pre="gpt2"))
    _raises("no tokenizer.json", Tokenizer.from_dir, tmp_path, exc=FileNotFoundError)
    _raises("encode takes a str", tok.encode, [1, 2], exc=TypeError)
    _raises(r"token ids \[9999\] are outside", tok.decode, [1, 9999])
    _raises("outside", tok.decode, [-1])
    _raises("at least one message", tok.apply_chat_template, [])
    _raises("'role' and a 'content'", tok.apply_chat_template, [{"role": "user"}])
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "n.gguf", tokens=_TOKENS[3:], types=_TYPES[3:], eos=0))
    _raises("no chat template and no ChatML tokens", tok.apply_chat_template,
            [{"role": "user", "content": "x"}])
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    tok.backend.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    _raises("tokenizer_config.json: eos_token '<\\|nope\\|>' is not in the vocabulary",
            Tokenizer.from_dir, hf_dir)
