"""Rule options and method specs from flags: the options are the fields of the rule objects
(`specjax.verify.Fly`, `Asd`, ...), so a new option of a rule is a new flag with no table to keep."""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import app, flags

import specjax
from specjax import models, verify

from experiments import _calibration_files
from experiments import _cli
from experiments import _prompts
from experiments import _models


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes"):
        return True
    if str(v).lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"not a boolean: {v!r}")


_PARSE = {"int": int, "float": float, "float | None": float, "str": str, "bool": _bool}
# flag name of an option where the bare name would be ambiguous; the memory's capacity is --csd_capacity
FLAG_NAMES = {"update": "csd_update"}
NOT_FLAGS = ("capacity",)


def rule_options() -> dict[str, dataclasses.Field]:
    """Every option of every rule object (its first owner's help text), in rule order."""
    out: dict[str, dataclasses.Field] = {}
    for cls in verify.RULES.values():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f)
    return out


def parse_option(name: str, value: str):
    """A rule option's value from text, by the field's type (ValueError if it does not parse)."""
    f = rule_options()[name]
    value = _PARSE[str(f.type)](value)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}")
    return value


def define_rule_flags() -> None:
    """--theta, --window, ... one flag per rule option (default unset: the rule's default)."""
    for name, f in rule_options().items():
        if name in NOT_FLAGS:
            continue
        text = f.metadata["help"] + " (unset: the rule's default)"
        flag, kind = FLAG_NAMES.get(name, name), str(f.type)
        if f.metadata.get("choices"):
            flags.DEFINE_enum(flag, None, list(f.metadata["choices"]), text)
        elif kind == "bool":
            flags.DEFINE_boolean(flag, None, text)
        elif kind == "int":
            flags.DEFINE_integer(flag, None, text)
        else:
            flags.DEFINE_float(flag, None, text)


def rule_options_from_flags() -> dict[str, Any]:
    FLAGS = flags.FLAGS
    out = {}
    for name in rule_options():
        if name in NOT_FLAGS:
            continue
        value = FLAGS[FLAG_NAMES.get(name, name)].value
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
    flags.DEFINE_string("model", models.DEFAULT_PRESET, f"Target model (preset, .gguf, HF directory, {_models.RANDOM}[:SEED]).")
    flags.DEFINE_string("draft", None, "Draft model (preset, .gguf, HF directory, random:tiny[:SEED]) or self:N. "
                        "Required.")
    _prompts.define_prompt_flags(dataset="mtbench", num_prompts=num_prompts)
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
            options.setdefault("csd_memory", _calibration_files.load_csd_memory(FLAGS.csd_memory, vocab_size, FLAGS.csd_capacity))
        elif FLAGS.csd_capacity is not None:
            options.setdefault("csd_memory", FLAGS.csd_capacity)
    if method == "asd" and FLAGS.asd_calibration:
        cal = _calibration_files.load_asd_calibration(FLAGS.asd_calibration)
        if cal["k"] != k:
            _cli.log(f"warning: {FLAGS.asd_calibration} was calibrated at k={cal['k']}, running k={k}")
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
            elif name in rule_options():
                options[name] = parse_option(name, value)
            else:
                raise app.UsageError(f"method spec {spec!r}: unknown option {name!r} (draft, k, "
                                     f"{', '.join(rule_options())})")
        except ValueError as e:
            raise app.UsageError(f"method spec {spec!r}: bad value for {name}: {e}") from None
    return method, options


def make_engine(target: models.Model, draft, method: str, k: int, max_new_tokens: int, **kwargs) -> specjax.Engine:
    """specjax.Engine with bad settings reported as app.UsageError (before anything compiles)."""
    try:
        return specjax.Engine(target, draft=draft, method=method, k=k, max_new_tokens=max_new_tokens, **kwargs)
    except (ValueError, TypeError) as e:
        raise app.UsageError(str(e)) from None
