"""What the experiment binaries share: models and drafters from flags, rule options,
prompts, calibration files, chunked runs with progress, teacher forcing, the
HumanEval sandbox, and the machine's description.

Model specs (every `--model` / `--draft` flag):
  a preset name, a .gguf file, a Hugging Face directory    -> `specjax.models.load`
  random:tiny[:SEED]   a 2-layer random model (vocabulary 258) with a byte-level
                       tokenizer and ChatML tokens: fast tests, no checkpoint needed
Draft specs: none | pld | self:N | <model spec> | pld+<model spec>.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import platform
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
from absl import app, flags

import specjax
from specjax import models, verify

RANDOM = "random:tiny"
DATASETS = ("mtbench", "humaneval")

# --- logging and progress ------------------------------------------------------


def log(msg: str) -> None:
    print(f"[specjax] {msg}", file=sys.stderr, flush=True)


class Ticker:
    """Prints the elapsed time of a long call on stderr: a live line on a terminal,
    otherwise a line every `every` seconds (the generation is one compiled program,
    so there is nothing finer to report while it runs)."""

    def __init__(self, what: str, every: float = 30.0):
        self.what, self.every = what, every
        self._stop = threading.Event()
        self._tty = sys.stderr.isatty()

    def _run(self):
        start = time.perf_counter()
        period = 1.0 if self._tty else self.every
        while not self._stop.wait(period):
            elapsed = time.perf_counter() - start
            if self._tty:
                print(f"\r[specjax] {self.what} ... {elapsed:.0f}s", end="", file=sys.stderr, flush=True)
            else:
                log(f"{self.what} ... {elapsed:.0f}s")

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    return (f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on {len(jax.devices())} x "
            f"{dev.platform} ({kind})")


# --- models ----------------------------------------------------------------------


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
    log(f"loading {spec} ...")
    try:
        m = models.load(spec)
    except (models.PresetError, FileNotFoundError, models.ConfigError) as e:
        raise app.UsageError(f"cannot load model {spec!r}: {e}") from None
    log(f"loaded {spec} in {m.load_seconds:.1f}s ({m.load_source}); {m.config.num_layers} layers, "
        f"vocab {m.config.vocab_size}")
    if m.tokenizer is None:
        raise app.UsageError(f"{spec} has no tokenizer; pass a GGUF or a directory with tokenizer.json")
    return m


def self_draft_model(target: models.Model, n: int) -> models.Model:
    """The target's first n layers (with its embedding, final norm and head) as a Model."""
    from specjax import drafters

    if not 1 <= n < target.config.num_layers:
        raise app.UsageError(f"self:{n}: N must be in [1, {target.config.num_layers - 1}]")
    config = dataclasses.replace(target.config, num_layers=n)
    return models.Model(config, drafters.self_draft_params(target.params, n), target.tokenizer,
                        f"self:{n}", target.dtype)


def resolve_draft(spec: str | None, target_spec: str):
    """The Engine's `draft` argument of a draft spec: None, "pld", "self:N", a Model or ("pld", Model)."""
    if spec is None or spec.lower() in ("", "none"):
        return None
    if spec in ("pld",) or spec.startswith("self:"):
        if spec.startswith("self:") and not spec[5:].isdigit():
            raise app.UsageError(f"--draft {spec!r}: expected self:N with an integer N")
        return spec
    if spec.startswith("pld+"):
        return ("pld", load_model(spec[4:]))
    return load_model(spec)


def draft_model(spec: str | None, target: models.Model) -> models.Model:
    """A draft that can be teacher-forced (calibration): a model spec or self:N."""
    if spec is None or spec.lower() in ("", "none", "pld") or spec.startswith("pld+"):
        raise app.UsageError(f"--draft {spec!r}: calibration needs a draft model (a preset, a checkpoint, "
                             f"{RANDOM}[:SEED] or self:N), not prompt lookup")
    if spec.startswith("self:"):
        if not spec[5:].isdigit():
            raise app.UsageError(f"--draft {spec!r}: expected self:N with an integer N")
        return self_draft_model(target, int(spec[5:]))
    draft = load_model(spec)
    if draft.config.vocab_size != target.config.vocab_size:
        raise app.UsageError(f"vocabulary mismatch between draft ({draft.config.vocab_size} tokens) and "
                             f"target ({target.config.vocab_size} tokens)")
    return draft


# --- prompts -------------------------------------------------------------------------


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
        from specjax import data

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


# --- rule options ------------------------------------------------------------------------

# option -> (type, flag help). Passed to the Engine only when set.
RULE_OPTIONS: dict[str, tuple[Callable, str]] = {
    "theta": (float, "fly: entropy threshold (also gates asd/csd when set)"),
    "window": (int, "fly: deferred window W"),
    "entropy": (str, "fly: entropy kind, normalized | top3"),
    "rule": (str, "fly: paper | reference"),
    "budget": (float, "asd: request-level regret budget"),
    "gate": (float, "asd: per-mismatch regret gate g"),
    "block_cap": (int, "asd: loose mismatches per block m"),
    "suffix": (str, "asd: suffix weight, count | fraction"),
    "min_count": (int, "csd: memory count a pair must exceed (lambda)"),
    "tau": (float, "csd: consistency threshold (log-probability gap >= log tau)"),
    "update": (lambda v: _bool(v), "csd: update the memory online"),
    "epsilon": (float, "typical: epsilon"),
    "delta": (float, "typical: delta"),
}
ENUMS = {"entropy": ("normalized", "top3"), "rule": ("paper", "reference"), "suffix": ("count", "fraction")}


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes"):
        return True
    if str(v).lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def define_rule_flags() -> None:
    """--theta, --window, ... one flag per rule option (default unset: the rule's default)."""
    for name, (kind, text) in RULE_OPTIONS.items():
        text += " (unset: the rule's default)"
        if name in ENUMS:
            flags.DEFINE_enum(name, None, ENUMS[name], text)
        elif name == "update":
            flags.DEFINE_boolean("csd_update", None, text)
        elif kind is int:
            flags.DEFINE_integer(name, None, text)
        else:
            flags.DEFINE_float(name, None, text)


def rule_options_from_flags() -> dict[str, Any]:
    FLAGS = flags.FLAGS
    out = {}
    for name in RULE_OPTIONS:
        value = FLAGS["csd_update" if name == "update" else name].value
        if value is not None:
            out[name] = value
    return out


def define_calibration_flags() -> None:
    flags.DEFINE_string("csd_memory", None, "Directory of a CSD memory saved by calibrate_csd.py "
                        "(method csd; unset: an empty memory).")
    flags.DEFINE_integer("csd_capacity", None, "Capacity of the CSD memory (unset: the saved one, "
                         "or the rule's default for an empty memory).")
    flags.DEFINE_string("asd_calibration", None, "JSON written by calibrate_asd.py: sets budget, gate, "
                        "block_cap and suffix of method asd (explicit flags win).")


def define_calibration_source_flags(num_prompts: int = 40, max_new_tokens: int = 128) -> None:
    """The flags both calibration binaries share: target, draft, prompts, greedy decoding, cache."""
    flags.DEFINE_string("model", models.DEFAULT_PRESET, f"Target model (preset, .gguf, HF directory, {RANDOM}[:SEED]).")
    flags.DEFINE_string("draft", None, "Draft model (preset, .gguf, HF directory, random:tiny[:SEED]) or self:N. "
                        "Required.")
    flags.DEFINE_enum("dataset", "mtbench", list(DATASETS), "Prompt source (unless --prompts_file).")
    flags.DEFINE_string("prompts_file", None, "Text file, one prompt per line (replaces --dataset).")
    flags.DEFINE_integer("num_prompts", num_prompts, "Calibration prompts: the first N after --prompt_offset.")
    flags.DEFINE_integer("prompt_offset", 0, "Skip this many prompts first.")
    flags.DEFINE_boolean("chat", True, "Wrap prompts in the chat template.")
    flags.DEFINE_integer("max_new_tokens", max_new_tokens, "Greedy continuation length per prompt (EOS may stop "
                         "earlier).")
    flags.DEFINE_integer("batch_size", 4, "Prompts per greedy-decoding call.")
    flags.DEFINE_integer("bucket", 128, "Teacher-forcing buffers are padded to a multiple of this.")
    flags.DEFINE_string("cache_dir", None, "Directory to keep the target's greedy sequences and both models' "
                        "teacher-forced argmax/regret in, keyed by models, prompts and lengths, so that "
                        "calibrate_csd and calibrate_asd on the same prompts decode them once.")
    flags.mark_flags_as_required(["draft"])


def validate_calibration_source_flags() -> None:
    FLAGS = flags.FLAGS
    for name in ("num_prompts", "max_new_tokens", "batch_size", "bucket"):
        if FLAGS[name].value <= 0:
            raise app.UsageError(f"--{name} must be positive, got {FLAGS[name].value}")
    if FLAGS.prompt_offset < 0:
        raise app.UsageError(f"--prompt_offset must be >= 0, got {FLAGS.prompt_offset}")


def apply_calibration(method: str, options: dict[str, Any], vocab_size: int, k: int) -> dict[str, Any]:
    """Adds the --csd_memory / --asd_calibration settings to a method's options."""
    FLAGS = flags.FLAGS
    options = dict(options)
    if method == "csd":
        if FLAGS.csd_memory:
            options.setdefault("csd_memory", load_csd_memory(FLAGS.csd_memory, vocab_size, FLAGS.csd_capacity))
        elif FLAGS.csd_capacity is not None:
            options.setdefault("csd_memory", FLAGS.csd_capacity)
    if method == "asd" and FLAGS.asd_calibration:
        cal = load_asd_calibration(FLAGS.asd_calibration)
        if cal["k"] != k:
            log(f"warning: {FLAGS.asd_calibration} was calibrated at k={cal['k']}, running k={k}")
        for name in ("budget", "gate", "block_cap", "suffix"):
            options.setdefault(name, cal[name])
    return options


def parse_method_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """"fly:theta=0.3,window=6,draft=pld,k=8" -> ("fly", {...}); draft and k are not rule options."""
    method, _, rest = spec.partition(":")
    if method not in verify.METHODS:
        raise app.UsageError(f"method spec {spec!r}: unknown method {method!r} "
                             f"(one of {', '.join(verify.METHODS)})")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        if not eq:
            raise app.UsageError(f"method spec {spec!r}: expected name=value, got {item!r}")
        try:
            if name == "draft":
                options[name] = value
            elif name == "k":
                options[name] = int(value)
            elif name in RULE_OPTIONS:
                options[name] = RULE_OPTIONS[name][0](value)
            else:
                raise app.UsageError(f"method spec {spec!r}: unknown option {name!r} (draft, k, "
                                     f"{', '.join(RULE_OPTIONS)})")
        except ValueError as e:
            raise app.UsageError(f"method spec {spec!r}: bad value for {name}: {e}") from None
        if name in ENUMS and value not in ENUMS[name]:
            raise app.UsageError(f"method spec {spec!r}: {name} must be one of {', '.join(ENUMS[name])}")
    return method, options


def make_engine(target: models.Model, draft, method: str, k: int, max_new_tokens: int, **kwargs) -> specjax.Engine:
    """specjax.Engine with bad settings reported as app.UsageError (before anything compiles)."""
    try:
        return specjax.Engine(target, draft=draft, method=method, k=k, max_new_tokens=max_new_tokens, **kwargs)
    except (ValueError, TypeError) as e:
        raise app.UsageError(str(e)) from None


# --- calibration files ---------------------------------------------------------------------


def save_csd_memory(path: str | os.PathLike, pairs_P2: np.ndarray, counts_P: np.ndarray, capacity: int,
                    metadata: dict[str, Any]) -> pathlib.Path:
    """Saves the memory of (pairs, counts, capacity) under path/memory (`verify.save_csd_memory`)
    and the calibration's description in path/calibration.json."""
    path = pathlib.Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    verify.save_csd_memory(path / "memory", verify.csd_memory(capacity, np.asarray(pairs_P2, np.int32).reshape(-1, 2),
                                                              np.asarray(counts_P, np.int32)), overwrite=True)
    (path / "calibration.json").write_text(json.dumps(metadata, indent=1))
    return path


def load_csd_memory(path: str | os.PathLike, vocab_size: int | None = None,
                    capacity: int | None = None) -> verify.CSDMemory:
    """The CSD memory saved by `save_csd_memory` (`--csd_memory`), as a verify.CSDMemory.

    capacity: None keeps the saved capacity. Token ids past vocab_size are an error.
    """
    path = pathlib.Path(path).resolve()
    if not (path / "memory").is_dir():
        raise app.UsageError(f"--csd_memory {path}: no saved memory there (expected {path}/memory, "
                             "written by experiments/calibrate_csd.py)")
    try:
        return verify.load_csd_memory(path / "memory", capacity, vocab_size)
    except ValueError as e:
        raise app.UsageError(f"--csd_memory {path}: {e}") from None


def load_asd_calibration(path: str | os.PathLike) -> dict[str, Any]:
    try:
        cal = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise app.UsageError(f"--asd_calibration {path}: {e}") from None
    missing = {"budget", "gate", "block_cap", "suffix", "k"} - set(cal)
    if missing:
        raise app.UsageError(f"--asd_calibration {path}: missing {', '.join(sorted(missing))}")
    return cal


# --- running prompts ------------------------------------------------------------------------


def chunks(items: Sequence, size: int) -> list:
    return [items[i: i + size] for i in range(0, len(items), size)]


def compile_for(engine: specjax.Engine, batches: Sequence[Sequence[Sequence[int]]]) -> float:
    """Compiles the engine's program for every batch's shapes (warm-up, untimed); seconds.

    `lower().compile()` fills the same cache that `generate` reads; for shapes
    already compiled it returns at once."""
    start = time.perf_counter()
    for batch in batches:
        engine.lower(list(batch)).compile()
    return time.perf_counter() - start


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    stats: dict[str, Any]
    seconds: float  # generation only, compilation excluded

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


def run(engine: specjax.Engine, ids: Sequence[Sequence[int]], batch_size: int, *, label: str = "",
        progress: bool = False, on_batch: Callable | None = None, warm: bool = True) -> Run:
    """Generates for every prompt, `batch_size` at a time; compilation first (untimed) when `warm`."""
    batches = chunks(list(ids), batch_size)
    if warm:
        seconds = compile_for(engine, batches)
        if progress:
            log(f"{label}compiled in {seconds:.1f}s")
    tokens, all_stats, total = [], [], 0.0
    for i, batch in enumerate(batches):
        what = f"{label}batch {i + 1}/{len(batches)}" if batch_size > 1 else f"{label}prompt {i + 1}/{len(batches)}"
        with Ticker(what) if progress else _Null():
            start = time.perf_counter()
            out = engine.generate(list(batch))
            seconds = time.perf_counter() - start
        total += seconds
        tokens += out.tokens
        all_stats.append(out.stats)
        if progress:
            n = sum(len(t) for t in out.tokens)
            log(f"{what}: {n} tokens in {seconds:.2f}s ({n / seconds:.1f} tokens/s), tau {out.stats['tau']:.2f}")
        if on_batch is not None:
            on_batch(i, batch, out)
    return Run(tokens, merge_stats(all_stats), total)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def merge_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Engine statistics of several generate calls as if they were one (SPEC.md, Metrics)."""
    out: dict[str, Any] = {}
    cat = lambda key: [x for p in parts for x in p[key]]  # noqa: E731
    out["tau_per_request"] = cat("tau_per_request")
    out["tau"] = float(np.mean(out["tau_per_request"])) if out["tau_per_request"] else 0.0
    out["rounds_per_request"] = cat("rounds_per_request")
    out["round_tokens_per_request"] = cat("round_tokens_per_request")
    out["rounds"] = max((p["rounds"] for p in parts), default=0)
    if parts and "accepted_counts_per_position" in parts[0]:
        accepted = np.sum([p["accepted_counts_per_position"] for p in parts], axis=0)
        offered = np.sum([p["offered_per_position"] for p in parts], axis=0)
        out["accepted_per_round"] = float(accepted.sum() / max(sum(out["rounds_per_request"]), 1))
        out["accepted_per_position"] = np.where(offered > 0, accepted / np.maximum(offered, 1), 0.0).tolist()
        out["loose"] = int(sum(p["loose"] for p in parts))
        out["mismatches_examined"] = int(sum(p["mismatches_examined"] for p in parts))
        out["loose_share"] = out["loose"] / out["mismatches_examined"] if out["mismatches_examined"] else 0.0
        out["loose_per_request"] = cat("loose_per_request")
        out["ledger_spent_per_request"] = cat("ledger_spent_per_request")
        if "csd_memory_filled" in parts[0]:
            out["csd_memory_filled_max"] = max(p["csd_memory_filled"] for p in parts)
            out["csd_memory_capacity"] = parts[0]["csd_memory_capacity"]
            out["csd_memory_dropped"] = int(sum(p["csd_memory_dropped"] for p in parts))
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two token lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    firsts = [first_difference(o, r) for o, r in zip(outputs, reference)]
    diverged = [f for f in firsts if f is not None]
    return {
        "divergence": len(diverged) / len(firsts) if firsts else 0.0,
        "diverged": len(diverged),
        "first_diff_per_request": firsts,
        "first_diff_median": float(np.median(diverged)) if diverged else None,
        "first_diff_min": int(min(diverged)) if diverged else None,
    }


def pareto(points_xy, minimize_x: bool = True) -> list[tuple[float, float]]:
    """The non-dominated points: y large and x small (or large), sorted along x."""
    pts = sorted(points_xy, key=lambda p: (p[0] if minimize_x else -p[0], -p[1]))
    front, best = [], float("-inf")
    for x, y in pts:
        if y > best:
            front.append((x, y))
            best = y
    return front


def write_csv(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> None:
    import csv

    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in keys})


def _cell(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, dict, tuple)):
        return json.dumps(v)
    return "" if v is None else v


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)
