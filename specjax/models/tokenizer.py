"""Tokenizer: a `tokenizers` byte-level BPE built from GGUF metadata or `tokenizer.json`, plus chat templates.

The BPE itself is the `tokenizers` library's; this module only assembles it from what a checkpoint
stores. A GGUF has no `tokenizer.json`: it keeps the vocabulary, the merges, the token types, the
special ids and the chat template as metadata under llama.cpp's key names, and names its
pre-tokenizer in `tokenizer.ggml.pre`. For that name we rebuild the pipeline of the model's own
`tokenizer.json` (the one llama.cpp's regexes also implement):

    smollm     Digits(individual) -> ByteLevel(GPT-2 regex)                    SmolLM2, StarCoder
    qwen2      NFC; Split(Qwen2 regex) -> ByteLevel(no regex)                  Qwen2, Qwen2.5(-Coder)
    llama-bpe  Split(Llama-3 regex) -> ByteLevel(no regex); BPE ignore_merges  Llama 3
    gpt2       ByteLevel(GPT-2 regex)                                          GPT-2

transformers' own GGUF tokenizer differs from these in two places (tests/test_tokenizer.py pins both):
it has no `Digits` step for "smollm", so a run of whitespace before a digit splits differently
("x\\n    1": ours and SmolLM2's tokenizer.json give `ĊĠĠĠĠ 1`, transformers `ĊĠĠĠ Ġ 1`); and no NFC
for "qwen2", which only matters for text that is not already NFC.

    tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tok.chat_prompt_ids("Write a haiku.")       # ChatML prompt, ready for the model
    text = tok.decode(new_ids, skip_special_tokens=True)
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from specjax._files import LoadError

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# The split regexes of the models' own tokenizer.json files.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _smollm():
    # SmolLM2's tokenizer.json; llama.cpp's "smollm" is the same: \p{N} first, then GPT-2's regex.
    return None, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]), False


def _qwen2():
    return normalizers.NFC(), _split_then_bytes(_QWEN2_SPLIT), False


def _llama3():
    # Llama-3's tokenizer.json takes a pre-token that is in the vocabulary whole, before merging.
    return None, _split_then_bytes(_LLAMA3_SPLIT), True


def _gpt2():
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


# tokenizer.ggml.pre -> () -> (normalizer, pre_tokenizer, ignore_merges)
_PRE_TOKENIZERS = {
    "smollm": _smollm,
    "starcoder": _smollm,
    "qwen2": _qwen2,
    "deepseek-r1-qwen": _qwen2,
    "llama-bpe": _llama3,
    "llama3": _llama3,
    "gpt2": _gpt2,
}

# The system prompt the instruct models' templates insert when a conversation has none, for the
# ChatML fallback (a jinja template, when present, carries its own).
_DEFAULT_SYSTEM = {
    "smollm": "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "qwen2": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
}


class Tokenizer:
    """A `tokenizers.Tokenizer` with the special ids and the chat template of a checkpoint.

    Build it with `from_gguf` or `from_dir`. `backend` is the wrapped `tokenizers.Tokenizer`;
    `vocab_size` is the number of ids (0 .. vocab_size - 1), special tokens included.
    """

    def __init__(self, backend: _Backend, *, vocab_size: int, bos_token_id: int | None,
                 eos_token_id: int | None, pad_token_id: int | None = None,
                 chat_template: str | None = None, default_system_prompt: str | None = None):
        self.backend = backend
        self.vocab_size = int(vocab_size)
        for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id),
                            ("pad_token_id", pad_token_id)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary of {self.vocab_size} ids")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.default_system_prompt = default_system_prompt
        self._compiled: tuple[str, Any] | None = None

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader, *, pre: str | None = None) -> Tokenizer:
        """From a GGUF file's tokenizer metadata: a path, or an open `gguf.GGUFReader` to share.

        `pre` overrides `tokenizer.ggml.pre` (for a file that lacks it; or `pre="gpt2"` for a
        "smollm" file reproduces transformers' GGUF tokenizer exactly).
        """
        import gguf

        if isinstance(path_or_reader, gguf.GGUFReader):
            reader = path_or_reader
            where = getattr(getattr(reader, "data", None), "filename", None) or "GGUF file"
        else:
            where = os.fspath(path_or_reader)
            from specjax.models import convert

            reader = convert.open_gguf(where)  # a missing, empty or truncated file: a LoadError naming it

        def field(key, default=KeyError):
            f = reader.fields.get(key)
            if f is None:
                if default is KeyError:
                    raise LoadError(where, f"this GGUF file has no tokenizer metadata {key!r}")
                return default
            return f.contents()

        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            kind = {"llama": " (SentencePiece)", "t5": " (Unigram)", "bert": " (WordPiece)"}.get(model, "")
            raise LoadError(where, f"unsupported tokenizer model {model!r}{kind}; specjax builds "
                            "byte-level BPE tokenizers only (tokenizer.ggml.model = 'gpt2')")
        tokens = field("tokenizer.ggml.tokens")
        merges = field("tokenizer.ggml.merges")
        token_types = field("tokenizer.ggml.token_type", None) or [_NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise LoadError(where, f"{len(token_types)} token types for {len(tokens)} tokens")
        pre_name = pre if pre is not None else field("tokenizer.ggml.pre", None)
        if pre_name is None:
            raise LoadError(where, f"this GGUF file has no 'tokenizer.ggml.pre'; pass pre= one of "
                            f"{sorted(_PRE_TOKENIZERS)}")
        if pre_name not in _PRE_TOKENIZERS:
            raise LoadError(where, f"unknown pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); "
                            f"supported: {sorted(_PRE_TOKENIZERS)}")
        if field("tokenizer.ggml.add_space_prefix", False):
            raise LoadError(where, f"tokenizer.ggml.add_space_prefix = True is not supported "
                            "for a byte-level BPE")

        backend = _byte_level_bpe(tokens, merges, token_types, pre_name, where)
        bos = field("tokenizer.ggml.bos_token_id", None)
        eos = field("tokenizer.ggml.eos_token_id", None)
        template = []  # what encode(add_special_tokens=True) adds around the text
        for name, tid in (("bos", bos), ("eos", eos)):
            if field(f"tokenizer.ggml.add_{name}_token", False):
                if tid is None:
                    raise LoadError(where, f"tokenizer.ggml.add_{name}_token is set, "
                                    f"but the file has no {name} token id")
                template.append((name, tokens[tid], tid))
        if template:
            pieces = [t for n, t, _ in template if n == "bos"] + ["$A"]
            pieces += [t for n, t, _ in template if n == "eos"]
            backend.post_processor = processors.TemplateProcessing(
                single=pieces, special_tokens=[(t, i) for _, t, i in template])
        return cls(backend, vocab_size=len(tokens), bos_token_id=bos, eos_token_id=eos,
                   pad_token_id=field("tokenizer.ggml.padding_token_id", None),
                   chat_template=field("tokenizer.chat_template", None),
                   default_system_prompt=_DEFAULT_SYSTEM.get(pre_name))

    @classmethod
    def from_dir(cls, hf_dir: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face directory: `tokenizer.json`, with the bos/eos tokens and the chat template
        of `tokenizer_config.json` (or of `chat_template.jinja` and `config.json` where it has none)."""
        hf_dir = os.fspath(hf_dir)
        path = os.path.join(hf_dir, "tokenizer.json")
        if not os.path.isfile(path):
            from specjax.models.convert import MissingFileError

            raise MissingFileError(hf_dir, "no tokenizer.json in this directory")
        try:
            backend = _Backend.from_file(path)
        except Exception as e:  # the library's own message ("EOF while parsing a string at line 56")
            raise LoadError(path, f"not a readable tokenizer.json ({e}): damaged or truncated") from e
        config = _read_json(os.path.join(hf_dir, "tokenizer_config.json"))
        model_config = _read_json(os.path.join(hf_dir, "config.json"))

        def token_id(name):
            token = config.get(name)
            if isinstance(token, Mapping):  # a serialized AddedToken
                token = token.get("content")
            if token is not None:
                tid = backend.token_to_id(token)
                if tid is None:
                    raise LoadError(os.path.join(hf_dir, "tokenizer_config.json"),
                                    f"{name} {token!r} is not in the vocabulary of tokenizer.json")
                return tid
            tid = model_config.get(f"{name}_id")
            return tid[0] if isinstance(tid, list) and tid else tid

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_path = os.path.join(hf_dir, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        return cls(backend, vocab_size=vocab_size, bos_token_id=token_id("bos_token"),
                   eos_token_id=token_id("eos_token"), pad_token_id=token_id("pad_token"),
                   chat_template=template)

    # --- saved state (the converted-parameter cache keeps one beside the weights) --------------

    _STATE_VERSION = 1
    _STATE_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "chat_template",
                     "default_system_prompt")

    def to_state(self) -> dict:
        """Everything this tokenizer is, as JSON-ready data: `from_state` rebuilds it in about a
        tenth of a second, where `from_gguf` must first parse every field of the GGUF (seconds)."""
        return {"version": self._STATE_VERSION, "backend": self.backend.to_str(),
                **{k: getattr(self, k) for k in self._STATE_FIELDS}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer that `to_state` described; ValueError for anything else."""
        if not isinstance(state, Mapping) or state.get("version") != cls._STATE_VERSION:
            raise ValueError("not a tokenizer state of this version")
        if not isinstance(state.get("backend"), str) or set(state) != {"version", "backend", *cls._STATE_FIELDS}:
            raise ValueError("a tokenizer state with missing or unknown fields")
        try:
            backend = _Backend.from_str(state["backend"])
        except Exception as e:  # the library's own parse error
            raise ValueError(f"unreadable tokenizer backend: {e}") from None
        return cls(backend, **{k: state[k] for k in cls._STATE_FIELDS})

    # --- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) become their ids.

        `add_special_tokens` adds the BOS/EOS the checkpoint asks for (SmolLM2 and Qwen2.5: none).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`: a list, or a 1-D NumPy/JAX array."""
        ids_N = [int(i) for i in ids]
        bad = [i for i in ids_N if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab_size} ids")
        return self.backend.decode(ids_N, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **template_vars) -> str:
        """The prompt text of a conversation, `[{"role": "user", "content": "..."}, ...]`.

        Renders the checkpoint's own jinja template the way transformers does (sandboxed, trim_blocks,
        lstrip_blocks); without jinja2 or a template, ChatML with the model's default system prompt.
        """
        if not messages:
            raise ValueError("apply_chat_template needs at least one message")
        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs a 'role' and a 'content', got {m!r}")
        messages = [dict(m) for m in messages]
        template = self._jinja_template()
        if template is None:
            return self._chatml(messages, add_generation_prompt)
        special = {name: None if tid is None else self.id_to_token(tid)
                   for name, tid in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                                     ("pad_token", self.pad_token_id))}
        return template.render(**{**special, **template_vars, "messages": messages,
                                  "add_generation_prompt": add_generation_prompt})

    def chat_prompt_ids(self, user_text: str, *, system: str | None = None) -> list[int]:
        """Ids of a one-turn chat prompt that ends with the assistant header, ready to generate from."""
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": user_text})
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))

    def _chatml(self, messages, add_generation_prompt) -> str:
        if self.token_to_id("<|im_start|>") is None or self.token_to_id("<|im_end|>") is None:
            raise ValueError("this tokenizer has no chat template and no ChatML tokens "
                             "(<|im_start|>, <|im_end|>) to fall back on")
        parts = []
        if self.default_system_prompt is not None and messages[0]["role"] != "system":
            parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
        parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def _jinja_template(self):
        if self.chat_template is None:
            return None
        if self._compiled is None or self._compiled[0] != self.chat_template:
            try:
                env = _jinja_env()
            except ImportError:
                return None
            self._compiled = (self.chat_template, env.from_string(self.chat_template))
        return self._compiled[1]

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_id={self.eos_token_id}, chat_template={self.chat_template is not None})")


def _byte_level_bpe(tokens, merges, token_types, pre_name, where) -> _Backend:
    """The `tokenizers` BPE of a GGUF vocabulary. Control tokens become special added tokens and
    user-defined ones (Qwen's `<tool_call>`) plain added tokens: both are matched whole in the text,
    at their own ids, as llama.cpp and transformers do."""
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise LoadError(where, "the GGUF vocabulary has duplicate tokens")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = [m for m, p in zip(merges, pairs) if len(p) != 2]
    if bad:
        raise LoadError(where, f"malformed tokenizer.ggml.merges (expected 'left right'): {bad[:3]}")
    normalizer, pre_tokenizer, ignore_merges = _PRE_TOKENIZERS[pre_name]()
    backend = _Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                  ignore_merges=ignore_merges))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, token_types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, token_types) if k == _USER_DEFINED])
    return backend


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise LoadError(path, f"not valid JSON ({e}): damaged or truncated") from None
    if not isinstance(d, dict):
        raise LoadError(path, f"a JSON {type(d).__name__}, not an object")
    return d


def _jinja_env():
    """A sandboxed jinja2 environment set up as transformers' `apply_chat_template` sets up its own."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
