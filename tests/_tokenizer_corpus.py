"""What the tokenizer tests share (test_tokenizer.py, test_tokenizer_synthetic.py): the text
corpus and conversations they run over, and a writer of small GGUF vocabularies."""

import inspect
import pathlib
import textwrap

import gguf

from specjax.models import tokenizer as tokenizer_lib


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
