r"""Compiles a whole speculative-decoding program for a TPU topology, on a host without a TPU.

    pip install -e ".[tpu-aot]"     # libtpu, at the version the installed jax pins
    JAX_PLATFORMS=cpu python experiments/aot_compile.py --topology=v5e:2x4 \
        --model=llama-3.1-8b --draft=llama-3.2-1b --method=fly --k=8 --batch_size=8 \
        --max_len=4096 --dtype=bfloat16

No weights are read: the models are abstract (`models.abstract`, parameters as
ShapeDtypeStructs) from a config name (`models.CONFIG_NAMES`), a preset name, or a
checkpoint path (only its config is read). The mesh is built on the topology's
device descriptions, `Engine.lower` traces the whole generation (prefill and the
while_loop of draft, score, verify, commit) with the Pallas kernels as compiled
Mosaic kernels, and the TPU compiler compiles it. The table gives, per device, the
planned parameters and KV caches and the compiled program's arguments, temporaries
(the caches are made inside the program) and code from `memory_analysis()`, against
the chip's HBM, and the number of Mosaic kernels in the compiled program. The TPU
compiler itself refuses a program whose temporaries exceed HBM; such a plan is
reported with the compiler's figure (not fitting) rather than as an error.

The prompts fill half of --max_len (the rest is the generation budget); --draft is
none, pld, a model, or pld+MODEL (FLy's multi-level drafting). A draft with a
narrower embedding table than the target's (Qwen2.5 0.5B/1.5B: 151936 ids, 7B:
152064; one tokenizer) is padded to the target's (`models.pad_vocab`). With
--cross_vocab the draft is of another family (--model=llama-3.1-8b --draft=qwen2.5-0.5b):
its tokens are translated in the program (specjax.cross_draft) through tables of the
two real vocabulary sizes, which the table counts ("translation tables").
--attention places the heads (default auto: where the model axis is wider than the KV
heads, each chip gets H/TP query heads and a copy of the KV head they read, docs/wide_tp.md);
--fsdp also splits the target's weights over the data axis of --mesh. Beside the planned
parameters and caches the table prints a hand count (`aot.hand_count`) of the same.
The last line is `RESULT {json}`; with --require_fit the exit status is 1 when the
program does not fit the chip's HBM.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from absl import flags

_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2", "TPU topology, e.g. v5e:2x2, v5e:2x4, v4:2x2x1, v5p:2x2x1, "
                                "v6e:2x4.")
_MESH = flags.DEFINE_string("mesh", "", "DATA,MODEL sizes of the ('data', 'model') mesh; default: 1,ALL chips.")
_MODEL = flags.DEFINE_string("model", "llama-3.1-8b", "Target: a config name (models.CONFIG_NAMES), a preset, "
                             "or a checkpoint path (.gguf / HF dir; only its config is read).")
_DRAFT = flags.DEFINE_string("draft", "llama-3.2-1b", "none, pld, a model (as --model), or pld+MODEL.")
_METHOD = flags.DEFINE_string("method", "fly", "Verification method (greedy/exact, fly, csd, asd, typical).")
_K = flags.DEFINE_integer("k", 8, "Draft tokens per round.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Prompts per batch.")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "Cache length (prompt + generated tokens).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Parameter, cache and compute dtype.")
_ATTENTION = flags.DEFINE_enum("attention", "auto", ["auto", "replicate", "pad", "repeat_kv"],
                               "How the heads are placed on the model axis (sharding.MeshConfig.attention): auto "
                               "shards them, repeating KV heads when the model axis is wider than G.")
_FSDP = flags.DEFINE_bool("fsdp", False, "Also split the target's weights over the data axis (gathered per layer).")
_CROSS = flags.DEFINE_bool("cross_vocab", False,
                           "The draft has another vocabulary (another family, e.g. --model=llama-3.1-8b "
                           "--draft=qwen2.5-0.5b): its tables are planned at the real vocabulary sizes "
                           "(vocab_bridge.AbstractVocab, tokens of up to --token_bytes bytes).")
_TOKEN_BYTES = flags.DEFINE_integer("token_bytes", 128, "With --cross_vocab: the longest token in bytes "
                                    "(Qwen2.5's tokenizer: 128).")
_REQUIRE_FIT = flags.DEFINE_bool("require_fit", False, "Exit with status 1 when the program does not fit HBM.")


def _abstract(source: str, dtype):
    from specjax import models
    from specjax.models import model as model_lib

    if source in models.CONFIG_NAMES:
        return models.abstract(source, dtype)
    path = pathlib.Path(source)
    if not path.exists():
        raise ValueError(f"unknown model {source!r}: not a config name ({', '.join(models.CONFIG_NAMES)}) "
                         "nor a checkpoint path")
    config, _ = model_lib._read_config_and_tokenizer(path, path.is_file())
    model = models.abstract(config, dtype)
    return model.with_params(model.params, name=path.name)


def _draft(spec: str, target, dtype):
    from specjax import models, vocab_bridge

    if spec in ("", "none"):
        return None, "none"
    if spec == "pld":
        return "pld", "pld"
    multi = spec.startswith("pld+")
    draft = _abstract(spec[4:] if multi else spec, dtype)
    if _CROSS.value:  # translated on the device: both vocabularies known by their sizes only
        draft = draft.with_params(draft.params, tokenizer=vocab_bridge.AbstractVocab(
            draft.config.vocab_size, _TOKEN_BYTES.value, _pieces(spec)))
    elif draft.config.vocab_size < target.config.vocab_size:
        draft = models.pad_vocab(draft, target.config.vocab_size)
    return (("pld", draft) if multi else draft), spec


def _pieces(name: str) -> str:
    """The pre-tokenizer of a preset's family (`specjax.pretokenize.KINDS`), for its abstract vocabulary."""
    for family, kind in (("qwen", "qwen2"), ("llama-3", "llama3"), ("smollm", "gpt2-digits")):
        if family in name.lower():
            return kind
    return "none"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def main(argv):
    del argv
    import jax.numpy as jnp

    import specjax
    from specjax import aot, sharding, vocab_bridge

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[_DTYPE.value]
    topology = _TOPOLOGY.value
    try:
        mesh_shape = tuple(int(x) for x in _MESH.value.split(",")) if _MESH.value else None
    except ValueError:
        sys.exit(f"error: --mesh must be DATA,MODEL (two integers), got {_MESH.value!r}")
    try:
        mesh = aot.topology_mesh(topology, mesh_shape)
    except (aot.TopologyError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    try:
        target = _abstract(_MODEL.value, dtype)
        if _CROSS.value:
            target = target.with_params(target.params, tokenizer=vocab_bridge.AbstractVocab(
                target.config.vocab_size, _TOKEN_BYTES.value, _pieces(_MODEL.value)))
        draft, draft_name = _draft(_DRAFT.value, target, dtype)
    except (ValueError, KeyError) as e:
        sys.exit(f"error: {e}")
    B, S, K = _BATCH.value, _MAX_LEN.value, _K.value
    prompt_len = S // 2
    max_new = S - prompt_len - K - 1
    if max_new < 1:
        sys.exit(f"error: --max_len {S} leaves no room for generation with k={K}")
    mesh_config = sharding.MeshConfig(mesh, attention=_ATTENTION.value, fsdp=_FSDP.value)
    try:
        engine = specjax.Engine(target, draft=draft, method=_METHOD.value, k=K, max_new_tokens=max_new, max_len=S,
                                mesh=mesh_config, eos_ids=(), prompt_bucket=prompt_len)
    except ValueError as e:  # heads the attention mode cannot place
        sys.exit(f"error: {e}")
    prompts = [[1] * prompt_len for _ in range(B)]
    try:
        r = aot.compile_report(engine, prompts, topology)
    except NotImplementedError as e:  # e.g. a Mosaic kernel GSPMD cannot partition
        sys.exit(f"error: the program does not compile for {topology}: {str(e).splitlines()[0]}")
    data, model = mesh.devices.shape
    itemsize = jnp.dtype(dtype).itemsize
    hand = aot.hand_count(engine.target.config, model, data, B, S, itemsize, _FSDP.value)
    draft_cfg = getattr(engine.drafter, "config", None) or getattr(getattr(engine.drafter, "model", None), "config", None)
    if draft_cfg is not None:
        d = aot.hand_count(draft_cfg, model, data, B, S, itemsize)
        hand = {k: hand[k] + d[k] for k in hand}
    rows = [
        ("topology", f"{topology} ({r.chips} chips, mesh data={data} model={model})"),
        ("target / draft", f"{_MODEL.value} / {draft_name}; {_METHOD.value}, K={K}, batch {B}, max_len {S}, "
                           f"{_DTYPE.value}"),
        ("heads", sharding.describe(engine.layout).replace("\n", "; ")),
        ("parameters (plan)", _gib(r.params_bytes) + f"  (hand count {_gib(hand['params'])})"),
        ("translation tables", _gib(r.bridge_bytes) + " (replicated; in the parameters)"),
        ("KV caches (plan)", _gib(r.cache_bytes) + f"  (hand count {_gib(hand['cache'])})"),
        ("arguments (compiled)", _gib(r.argument_bytes)),
        ("temporaries (compiled)", _gib(r.temp_bytes) + ("" if r.compiled else " (the compiler's total minus parameters)")),
        ("outputs + code", _gib(r.output_bytes + r.code_bytes)),
        ("total per device", _gib(r.bytes_per_device)),
        ("HBM per chip", _gib(r.hbm_bytes)),
        ("fits", "yes" if r.fits else f"NO ({r.bytes_per_device / r.hbm_bytes:.2f}x HBM)"),
        ("compiled", "yes" if r.compiled else f"no: {r.note}"),
        ("Mosaic kernels", f"{r.mosaic_kernels}" + ("" if r.compiled else " (in the lowered program)")),
        ("compile time", f"{r.compile_seconds:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    result = {"topology": topology, "chips": r.chips, "mesh": [data, model], "model": _MODEL.value,
              "draft": draft_name, "method": _METHOD.value, "dtype": _DTYPE.value,
              "attention": _ATTENTION.value, "fsdp": _FSDP.value, "params_bytes": r.params_bytes,
              "cache_bytes": r.cache_bytes, "bridge_bytes": r.bridge_bytes, "hand_params_bytes": hand["params"], "hand_cache_bytes": hand["cache"],
              "mosaic_kernels": r.mosaic_kernels, "bytes_per_device": r.bytes_per_device,
              "hbm_bytes_per_device": r.hbm_bytes, "fits": r.fits}
    print("RESULT " + json.dumps(result), flush=True)
    if _REQUIRE_FIT.value and not r.fits:
        print(f"error: {_gib(r.bytes_per_device)} per device does not fit {topology}'s {_gib(r.hbm_bytes)} HBM "
              "(--require_fit)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host computes nothing; libtpu stays quiet
    from experiments import _paths
    _paths.run(main)
