"""`specjax.Engine`: validates a request, then runs the one compiled generation program.

The program itself (prefill + one while_loop of draft, score, verify, commit)
is in `loop.py`; drafters in `drafters.py`; rules in `verify`. This module
turns the public arguments into those static pieces, catches bad input before
compiling, and turns the program's arrays into tokens and statistics. Its length (about 470
lines) is those checks, the memory check included: all of them run before anything compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax import _checks, compile_cache, drafters, loop, native, pallas, sharding, verify
from specjax.backend import Backend
from specjax.models import feature_draft, llama, quant
from specjax.models.model import Model

_CACHE_BUCKET = 64


def prompt_width(longest: int, bucket: int | None = None) -> int:
    """The padded prompt width a program is compiled for: a multiple of `bucket`, or (None)
    a geometric ladder 16, 32, 48, 64, 96, 128, 192, 256, 384, ... so that prompts of many
    lengths share few programs (lengths 20..400: 9) while the padding stays under half."""
    if bucket is not None:
        return -(-longest // bucket) * bucket
    width = 16
    while width < longest:
        width = width + 16 if width < 64 else width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return width


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # per prompt: the new tokens only, up to and including EOS
    stats: dict[str, Any]  # specjax.loop.statistics (docs/rules.md, Metrics)
    # the rule's final state: the CSD memory (with what this call taught it), the ASD
    # ledgers f32[B], or (); `generate(..., rule_state=out.rule_state)` carries it on
    rule_state: Any = ()
    # an adaptive engine's acceptance counts after this call (`loop.Adapt`), else ();
    # `generate(..., adaptation=out.adaptation)` starts the next call's policy from them
    adaptation: Any = ()


class Engine:
    """Compiles and runs generation.

    draft: None (target-only autoregressive decoding, the baseline), a `Model`
    sharing the target's vocabulary, "pld" (prompt lookup), "self:N" (the
    target's first N layers), ("pld", Model) (FLy's multi-level drafting), or a
    `models.FeatureDraft` (one layer over the target's hidden states, trained by
    experiments/train_draft.py --arch=feature); see `drafters.from_spec`.
    method: a rule object (`verify.Fly(theta=0.2)`, ...) or a method name (greedy/exact,
    fly, asd, csd, typical, sampling) with its options as keyword arguments
    (`method="fly", theta=0.2`); at temperature > 0, greedy/exact verify by lossless
    speculative sampling. `csd_memory` (csd only): a capacity, or a CSDMemory to start from.
    Beyond those: `eos_ids` overrides the tokens that end a row (default: the model's EOS;
    `()` generates exactly max_new_tokens, as benchmarks do), `pld_match` ("earliest" or
    "latest") picks prompt lookup's occurrence, and `prompt_bucket` is the multiple the
    longest prompt is padded to, or None for a geometric ladder of widths (`prompt_width`;
    the program's shapes follow from the width, so fewer widths compile fewer programs).
    Compiled programs are kept on disk (`specjax.compile_cache`).
    adaptive: each round verifies only the draft prefix whose expected tokens pay for its width
    (k is then the most), from the acceptance seen so far and `costs`, a `specjax.costs.CostTable`
    (seconds per verify width 1 .. k + 1 and per draft step) or None: measured once per engine
    configuration and batch size on this platform and kept on disk (docs/adaptive.md).
    adaptive=False verifies every proposal whole (the fixed-K loop, for experiments and ablations).
    matmul: "auto" (decode-sized matmuls on an unsharded CPU program run in specjax.native's
    kernel, which reads block codes inside the dot; elsewhere XLA's dot), "native" (required:
    an error where it cannot run), "q8" (the kernel's int8-activation path for block-quantized
    weights, at every size: each row of activations quantized to int8 per block of 32, as
    llama.cpp does, and integer dot products; faster, above all for a verify pass's K + 1 rows,
    but its logits are llama.cpp-like, not the float32 model's) or "xla" (always XLA's dot).
    The "native" kernel's logits agree with XLA's to float32 rounding, and are the same bit for
    bit from block codes or from their float32 dequantization. Where the matmuls are native
    ("auto" on a CPU, "native", "q8") cached attention is too (each query over its visible keys;
    `native.attention`). With "q8" every op of a
    position is computed per row (int8 matmuls, attention, the norms' fixed-order sums, RoPE and
    the elementwise rest): a token gets the same logits in a verify pass of K + 1 positions as
    when decoded alone, so exact speculation on this path gives q8 target-only's tokens.
    layers: "stacked" (a scan over layers: compile time independent of depth, block-quantized
    weights kept as codes; with the native kernel, in its tile-major order, 4-bit codes two per
    byte, read in place; engines of one model share that packed copy) or "unrolled" (one device
    only: a loop of layers, each with its own arrays: with the native kernel its packed codes, else
    float arrays, which XLA:CPU reads faster than codes it must dequantize into a buffer; compiles
    for longer; `llama.unstack_layers`).
    mesh: None (one device), a `jax.sharding.Mesh` with axes ("data", "model"), or a
    `sharding.MeshConfig` (rules, attention "auto"/"replicate"/"pad", draft "shard"/"replicate");
    params are placed once, caches and logits are constrained inside the program, and the
    batch must divide over "data" (see `specjax.sharding`).
    """

    def __init__(self, target: Model, draft=None, method: str | verify.Rule = "greedy", k: int = 8,
                 max_new_tokens: int = 128, max_len: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, mesh=None, eos_ids: Sequence[int] | None = None,
                 pld_match: str = "earliest", prompt_bucket: int | None = None, layers: str = "stacked",
                 matmul: str = "auto", adaptive: bool = True, costs=None, **rule_options):
        if not isinstance(target, Model):
            raise TypeError(f"target must be a specjax.models.Model, got {type(target).__name__}")
        _checks.engine_args(temperature=temperature, top_p=top_p, seed=seed, eos_ids=eos_ids)  # NaN, "12", 1.5
        compile_cache.enable()  # a second process with the same shapes loads its programs
        mesh_config = None if mesh is None else sharding.MeshConfig.of(mesh)  # validated before compiling
        feature = draft[1] if isinstance(draft, tuple) and len(draft) == 2 else draft
        if mesh_config is not None and isinstance(feature, feature_draft.FeatureDraft):
            raise ValueError("a FeatureDraft runs on one device only (its state has no sharding plan yet); "
                             "pass mesh=None, or a draft Model / 'pld' on a mesh")
        if mesh_config is not None:  # padded heads, or KV heads repeated for a model axis wider than them
            target, draft = _prepare_models(mesh_config, target, draft)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if max_len is not None and max_len <= 1:
            raise ValueError(f"max_len must be > 1, got {max_len}")
        if prompt_bucket is not None and (not isinstance(prompt_bucket, (int, np.integer))
                                          or isinstance(prompt_bucket, bool) or prompt_bucket < 1):
            raise ValueError(f"prompt_bucket must be a positive integer or None, got {prompt_bucket!r}")
        if pld_match not in ("earliest", "latest"):
            raise ValueError(f"pld_match must be 'earliest' or 'latest', got {pld_match!r}")
        if layers not in ("stacked", "unrolled"):
            raise ValueError(f"layers must be 'stacked' or 'unrolled', got {layers!r}")
        if layers == "unrolled" and mesh is not None:
            raise ValueError("layers='unrolled' runs on one device; on a mesh the stacked layers are sharded "
                             "(pass mesh=None or layers='stacked')")
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {adaptive!r}")
        if costs is not None:  # checked here, before anything compiles
            from specjax.costs import CostTable

            if not isinstance(costs, CostTable):
                raise ValueError(f"costs must be a specjax.costs.CostTable or None, got {type(costs).__name__}")
            costs.check(int(k) if isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 1 else 0)
        if matmul not in ("auto", "native", "q8", "xla"):
            raise ValueError(f"matmul must be 'auto', 'native', 'q8' or 'xla', got {matmul!r}")
        if matmul in ("native", "q8"):
            if mesh is not None:
                raise ValueError(f"matmul={matmul!r} runs on one device (a custom call has no sharding rule): "
                                 "pass mesh=None or matmul='auto'")
            if jax.default_backend() != "cpu" or not native.available():
                raise ValueError(f"matmul={matmul!r} needs the CPU kernel (backend {jax.default_backend()!r}, "
                                 f"built: {native.available()}; see specjax.native)")
            if matmul == "q8" and jnp.dtype(target.dtype) != jnp.float32:
                raise ValueError(f"matmul='q8' runs float32 models (the kernel's activations are float32 before "
                                 f"it quantizes them); the target is {jnp.dtype(target.dtype).name}")
        # a custom call has no sharding rule: "auto" is native only on one CPU device
        uses_native = matmul in ("native", "q8") or (
            matmul == "auto" and mesh is None and jax.default_backend() == "cpu" and native.available())
        self.layers, self.matmul = layers, matmul
        self.adaptive, self.costs = adaptive, costs
        self.target, self.k = target, int(k)
        self.prompt_bucket = None if prompt_bucket is None else int(prompt_bucket)
        self.max_new_tokens, self.max_len = int(max_new_tokens), max_len
        self.temperature, self.top_p, self.seed, self.mesh = float(temperature), float(top_p), seed, mesh
        self.eos_ids = tuple(int(e) for e in (target.eos_token_ids if eos_ids is None else eos_ids))
        self.rule, self._start_state = _rule(method, rule_options, self.temperature, draft is None)
        if isinstance(self._start_state, verify.CSDMemory):  # a memory of another tokenizer
            verify.check_csd_vocab("Engine", self._start_state, target.config.vocab_size)
        self.method = method if isinstance(method, str) else method.name
        self.drafter, draft_params = drafters.from_spec(draft, target, self.k, pld_match=pld_match,
                                                        temperature=self.temperature)
        if self.drafter is not None and self.top_p < 1.0:
            raise ValueError("top_p < 1 is only supported for target-only decoding (draft=None): "
                             "speculative sampling preserves the target's full distribution")
        # mesh: NamedShardings for params, caches and logits (specjax.sharding); None: one device
        self.layout = None if mesh_config is None else sharding.make_layout(
            mesh_config, target.config, getattr(getattr(self.drafter, "model", self.drafter), "config", None))
        self.backend = _backend(self.layout, "q8" if matmul == "q8" else "native" if uses_native else "xla")
        self.params = loop.Params(target=target.params, draft=draft_params)
        draft_dtype = getattr(getattr(self.drafter, "model", self.drafter), "dtype", target.dtype)
        if uses_native:
            # 4-bit layer codes two per byte, tile by tile: the native kernel streams half the bytes
            q8 = matmul == "q8"
            self.params = loop.Params(target=native.pack_params(self.params.target, target.dtype, q8),
                                      draft=native.pack_params(self.params.draft, draft_dtype, q8))
        if layers == "unrolled":  # the draft model too (prompt lookup has no params)
            unroll = lambda p, dtype: llama.unstack_layers(p, dtype) if isinstance(p, dict) and "layers" in p else p  # noqa: E731
            self.params = loop.Params(target=unroll(self.params.target, target.dtype),
                                      draft=unroll(self.params.draft, draft_dtype))
        if self.layout is not None:
            self.params = loop.Params(
                target=sharding.place(target.params, self.layout.param_shardings(target.params)),
                draft=sharding.place(draft_params, self.layout.param_shardings(draft_params, "draft"))
                if jax.tree.leaves(draft_params) else draft_params)

    # -- inputs --------------------------------------------------------------
    def _prepare(self, prompts: Sequence[Sequence[int]], rule_state=None, measure: bool = True, draft_prompts=None,
                 adaptation=None):
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        V = self.target.config.vocab_size
        lengths = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)) or len(p) == 0:
                raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.60}")
            arr = np.asarray(p)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompt {i} must be a flat list of integer token ids")
            if arr.min() < 0 or arr.max() >= V:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {V})")
            lengths.append(len(arr))
        longest = max(lengths)
        needed = longest + self.max_new_tokens + self.k + 1  # room for a final K+1-token round
        width = prompt_width(longest, self.prompt_bucket)
        if self.max_len is None:  # from the padded width, so that all shapes follow from it
            max_len = -(-(width + needed - longest) // _CACHE_BUCKET) * _CACHE_BUCKET
        else:
            max_len = self.max_len
            if needed > max_len:
                raise ValueError(
                    f"request does not fit the cache: longest prompt {longest} + max_new_tokens "
                    f"{self.max_new_tokens} + k {self.k} + 1 = {needed} > max_len {max_len}")
        llama.check_positions("Engine", self.target.config, longest + self.max_new_tokens,
                              "longest prompt + max_new_tokens")
        if self.layout is None or not self.layout.deviceless:  # AOT for a TPU topology: its compiler checks HBM
            cache_fits(cache_configs(self), self.target.dtype, len(prompts), max_len, self.max_new_tokens,
                       extra_bytes=draft_state_bytes(self, len(prompts), max_len))
        T = min(width, max_len)
        prompt_BT = np.zeros((len(prompts), T), np.int32)
        for i, p in enumerate(prompts):
            prompt_BT[i, : lengths[i]] = p
        program = loop.Program(config=self.target.config, max_new_tokens=self.max_new_tokens, max_len=max_len,
                               temperature=self.temperature, top_p=self.top_p, eos_ids=self.eos_ids,
                               dtype=self.target.dtype, drafter=self.drafter, rule=self.rule, layout=self.layout,
                               backend=self.backend, adaptive=self.adaptive)
        state = self._rule_state(len(prompts), rule_state)
        # host arrays: jit transfers them; the PRNG key is made inside the program
        inputs = dict(prompt_BT=prompt_BT, prompt_len_B=np.asarray(lengths, np.int32), seed=np.uint32(self.seed),
                      rule_state=state, costs=self._costs(program, len(prompts), measure),
                      draft_prompt=draft_prompt_inputs(self, draft_prompts, len(prompts), max_len),
                      adaptation=_adaptation(program, adaptation))
        if self.layout is not None:  # rows split over "data" (a batch it does not divide is an error)
            self.layout.check_batch(len(prompts))
            rows = self.layout.spec("rows")
            inputs = sharding.place(inputs, dict(prompt_BT=self.layout.named(rows),
                                                 prompt_len_B=self.layout.named(P(rows[0])),
                                                 seed=self.layout.replicated,
                                                 costs=jax.tree.map(lambda _: self.layout.replicated,
                                                                    inputs["costs"]),
                                                 rule_state=jax.tree.map(lambda _: self.layout.replicated, state),
                                                 adaptation=jax.tree.map(lambda _: self.layout.replicated,
                                                                         inputs["adaptation"]),
                                                 draft_prompt=(self.layout.named(rows), self.layout.named(P(rows[0])))
                                                 if inputs["draft_prompt"] else ()))
        return program, dict(params=self.params, **inputs)

    def _costs(self, program: loop.Program, batch_size: int, measure: bool = True):
        """The adaptive program's cost input (`loop.Program.cost_input`) from this batch size's table;
        () for a program that does not adapt. measure=False (lowering: only the shapes matter, and a
        deviceless AOT target cannot be timed): flat figures where no table was given."""
        if not program.adapts:
            return ()
        return program.cost_input(self.cost_table(batch_size) if measure or self.costs is not None else None)

    def cost_table(self, batch_size: int = 1):
        """The `specjax.costs.CostTable` the adaptive loop weighs widths against for this batch size
        (the given one, or measured on this platform); None without a draft or with adaptive=False."""
        if self.drafter is None or not self.adaptive:
            return None
        if self.costs is None:
            from specjax import costs  # host-side measuring, only for engines without a table

            return costs.measured(self, batch_size)  # each figure measured once per process (costs._MEMORY)
        return self.costs

    def _rule_state(self, batch_size: int, given):
        """The rule's starting state: `given`, checked against the rule's fresh state, or
        the memory given at construction, or the rule's fresh state."""
        if self.rule is None:
            if given is not None and jax.tree.leaves(given):
                raise ValueError("rule_state was given, but target-only decoding (draft=None) has no rule state")
            return ()
        fresh = jax.device_get(self.rule.init_state(batch_size))  # host arrays, as every other input
        if given is None:
            given = self._start_state
        if given is None:
            return fresh
        want, got = jax.tree.structure(fresh), jax.tree.structure(given)
        if want != got:
            raise ValueError(f"rule_state does not match method {self.method!r}'s state: expected the structure "
                             f"{want}, got {got} (pass the rule_state of an earlier output of this engine)")
        given = jax.device_get(given)  # host arrays, like `fresh`: one comparison, one jit cache entry
        if isinstance(given, verify.CSDMemory):  # a memory of another tokenizer
            verify.check_csd_vocab("Engine", given, self.target.config.vocab_size)
        # a CSD memory of any capacity is a valid start (its table's size is its own shape)
        any_size = isinstance(given, verify.CSDMemory)
        for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(given)):
            a, b = np.asarray(a), np.asarray(b)
            if (a.shape != b.shape and not any_size) or a.dtype != b.dtype:
                raise ValueError(f"rule_state does not match method {self.method!r}'s state: an array of "
                                 f"{b.dtype}{list(b.shape)} where {a.dtype}{list(a.shape)} is expected "
                                 + _checks.state_hint(self.method, a, b))
        return given

    # -- public --------------------------------------------------------------
    def prompt_width(self, prompts: Sequence[Sequence[int]]) -> int:
        """The padded prompt width these prompts compile for (one program per width)."""
        return prompt_width(max(len(p) for p in prompts), self.prompt_bucket)

    def generate(self, prompts: Sequence[Sequence[int]], rule_state=None, draft_prompts=None,
                 adaptation=None) -> GenerateOutput:
        """New tokens and statistics for each prompt (one compiled program for the whole batch).

        rule_state: the rule's starting state, e.g. the `rule_state` of an earlier output so
        that CSD's memory keeps what earlier calls taught it (default: the memory given at
        construction, else the rule's fresh state).
        draft_prompts: for a draft of another vocabulary only (docs/cross_vocab.md): per row, the
        same conversation in the draft's own ids, e.g. rendered by its own chat template
        (`draft.tokenizer.apply_chat_template(messages)`, encoded), where the draft otherwise reads
        the translation of `prompts`. It changes what the draft proposes, never what exact
        verification emits. Checked: one per prompt, ids in the draft's vocabulary.
        adaptation: an adaptive engine's acceptance counts to start from, the `adaptation` of an
        earlier output of an engine with the same drafter and k (default: none, even odds), so
        that a stream of requests keeps what earlier ones showed of the draft (docs/adaptive.md).
        Any batch size: the counts are per drafter level and draft position."""
        program, args = self._prepare(prompts, rule_state, draft_prompts=draft_prompts, adaptation=adaptation)
        out = jax.device_get(program.run(**args))
        tokens = [out.seq_BS[b, len(p): len(p) + out.num_out_B[b]].tolist() for b, p in enumerate(prompts)]
        stats = loop.statistics(out.counters, out.rule_state, out.widths_W)
        return flag_invalid(GenerateOutput(tokens, stats, out.rule_state, out.adapt))

    def lower(self, prompts: Sequence[Sequence[int]], rule_state=None, draft_prompts=None,
              adaptation=None) -> jax.stages.Lowered:
        """The whole generation for these prompts' shapes, lowered (`.compile()` fills the cache
        that `generate` reads)."""
        program, args = self._prepare(prompts, rule_state, measure=False, draft_prompts=draft_prompts,
                                      adaptation=adaptation)
        return loop.Program.run.lower(program, **args)


def _adaptation(program: loop.Program, given):
    """The adaptive program's starting counts as host arrays (none given: zeros, so that a fresh and
    a carried start share one compiled program), checked; () for a program that does not adapt.
    Built with numpy: zeros made by jnp would be device launches outside the one program."""
    if not program.adapts:
        if given is not None and jax.tree.leaves(given):
            raise ValueError("adaptation was given, but this engine does not adapt (draft=None or adaptive=False)")
        return ()
    return program.initial_adapt(() if given is None else jax.device_get(given), xp=np)


def _prepare_models(mesh_config: sharding.MeshConfig, target, draft):
    """(target, draft) as the engine runs them on the mesh: padded heads under attention="pad",
    repeated KV heads where the model axis is wider than the KV heads (`sharding.prepare_model`;
    the Model type is dispatched on here, since `sharding` never imports it).

    draft: anything `Engine` accepts; a Model (alone or in ("pld", Model)) is prepared too
    unless it is replicated.
    """
    if not sharding.needs_preparing(mesh_config):
        return target, draft
    target = sharding.prepare_model(mesh_config, target, "target")
    if mesh_config.draft == "shard":
        if isinstance(draft, Model):
            draft = sharding.prepare_model(mesh_config, draft, "draft")
        elif isinstance(draft, tuple) and len(draft) == 2 and isinstance(draft[1], Model):
            draft = (draft[0], sharding.prepare_model(mesh_config, draft[1], "draft"))
    return target, draft


def _backend(layout, matmul: str) -> Backend:
    """How the program computes, from its platform and layout (`specjax.backend.Backend`): the
    matmul path the Engine checked; where the matmuls are native, cached attention too (each
    query over its visible keys, in place in the cache); the LM head chunked on an unsharded
    CPU (`quant.default_head_chunk`); the Pallas kernels chosen for the mesh's platform (so a
    CPU host compiles Mosaic kernels for a TPU topology; impl, interpret mode and variant resolved
    here, the environment's $SPECJAX_PALLAS included) and run replicated on the mesh; the
    rules' statistics reduced shard by shard where the logits are split over the vocabulary."""
    if layout is None:
        platform, head_chunk, mesh, vocab_sharding = jax.default_backend(), quant.default_head_chunk(), None, None
    else:
        platform = layout.mesh.devices.flat[0].platform
        head_chunk = quant.default_head_chunk(platform, layout.vocab_sharded)
        mesh, vocab_sharding = layout.mesh, layout.vocab_sharding
    on = matmul != "xla"
    return pallas.resolve_backend(Backend(  # the Pallas choices resolved here, once: not per trace
        matmul=matmul, kernels=native if on else None, native_attention=on, head_chunk=head_chunk,
        platform=platform if platform in ("cpu", "gpu", "tpu") else None, mesh=mesh, vocab_sharding=vocab_sharding))


def _rule(method, options: dict, temperature: float, target_only: bool):
    """(rule object or None for target-only decoding, starting rule state or None: the rule's fresh one).

    A CSD memory given as `csd_memory` is starting state, not an option of the rule."""
    options = dict(options)
    start = None
    memory = options.pop("csd_memory", None)
    if isinstance(method, verify.Rule):
        if options or memory is not None:
            raise ValueError(f"options ({', '.join(sorted(options) or ['csd_memory'])}) come with a method name; "
                             f"the rule object {method} already holds its options")
        rule = method
    elif not isinstance(method, str) or method not in verify.METHODS:
        raise ValueError(f"unknown method {method!r} (supported: {', '.join(verify.METHODS)}, or a verify.Rule)")
    else:
        if memory is not None:
            if method != "csd":
                raise ValueError(f"option 'csd_memory' does not apply to method {method!r} (it is for csd)")
            if isinstance(memory, verify.CSDMemory):
                start = memory
                options["capacity"] = memory.capacity
            elif isinstance(memory, numbers.Integral) and not isinstance(memory, bool):
                options["capacity"] = int(memory)
            else:
                raise ValueError(f"Engine: csd_memory must be a capacity (int >= 1) or a CSDMemory, got {memory!r}")
        rule = verify.rule(method, **options)
    if target_only:  # (a Greedy takes no options)
        if not isinstance(rule, verify.Greedy):
            raise ValueError(f"method {rule.name!r} needs a draft: draft=None is target-only decoding")
        return None, None
    return verify.at_temperature(rule, temperature), start  # at T > 0 exact is speculative sampling


# --- the checks of a request that run before compiling: memory (and, in `_prepare`, the cache
# length and the positions the model was trained on), then the flag on invalid output ---


def available_bytes() -> tuple[int, str]:
    """Memory free for new buffers on the default backend: (bytes, where)."""
    devices = jax.local_devices()
    stats = [d.memory_stats() if hasattr(d, "memory_stats") else None for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        free = sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        return free, f"{len(devices)} {devices[0].platform} device(s)"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, "host memory"
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "host memory"


@functools.lru_cache(maxsize=64)
def _bytes_per_position(configs: tuple, dtype, batch: int) -> int:
    """Bytes of the KV caches of `configs` and the int32 token buffer per cache position (eval_shape: no work)."""
    def nbytes(config, length):
        shapes = jax.eval_shape(lambda: llama.init_cache(config, batch, length, dtype))
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    return batch * 4 + sum(nbytes(c, 2) - nbytes(c, 1) for c in configs)


def cache_fits(configs, dtype, batch: int, max_len: int, max_new_tokens: int, extra_bytes: int = 0) -> None:
    """Refuses, before compiling, KV caches (and the token buffer) larger than the memory left.

    extra_bytes: what else grows with max_len (a draft of another vocabulary's state, sized by
    itself: `draft_state_bytes`)."""
    per_position = _bytes_per_position(tuple(configs), dtype, batch)
    need = per_position * max_len + extra_bytes
    free, where = available_bytes()
    budget = int(0.9 * free)  # XLA's temporaries need some room too
    if need > budget:
        slope = -(-need // max_len)  # bytes per position of max_len, the extra included
        fits = max(0, budget // slope - (max_len - max_new_tokens) - 64)
        raise ValueError(f"Engine: max_new_tokens={max_new_tokens} needs caches of max_len {max_len} for a batch "
                         f"of {batch}: {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free in "
                         f"{where}; at most about max_new_tokens={fits} fits (or use a smaller batch)")


def cache_configs(engine: Engine) -> list:
    """The configs whose KV caches of max_len positions a generation allocates: the target's and a
    draft model's of the target's vocabulary (one of another vocabulary sizes its own cache,
    longer than max_len: `draft_state_bytes`)."""
    drafter = getattr(engine.drafter, "model", engine.drafter)  # MultiLevel holds its model drafter
    draft = None if hasattr(drafter, "state_bytes") else getattr(drafter, "config", None)
    return [engine.target.config] + ([draft] if draft is not None else [])


def draft_state_bytes(engine: Engine, batch: int, max_len: int) -> int:
    """Bytes of a drafter's state that sizes itself (`CrossVocabDrafter.state_bytes`: its cache is
    1.25 x max_len); 0 for the others, whose caches `cache_configs` counts at max_len."""
    drafter = getattr(engine.drafter, "model", engine.drafter)
    return drafter.state_bytes(batch, max_len) if hasattr(drafter, "state_bytes") else 0


def draft_prompt_inputs(engine: Engine, draft_prompts, rows: int, max_len: int):
    """`generate`'s draft_prompts as the program's input: () when None, else (ids right-padded to
    a prompt width, lengths); one clear error for a draft that reads the target's prompt, a count
    of rows that differs, or ids outside the draft's vocabulary or longer than its cache."""
    if draft_prompts is None:
        return ()
    from specjax import cross_draft

    drafter = engine.drafter
    if not isinstance(drafter, cross_draft.CrossVocabDrafter):
        what = "no draft" if drafter is None else f"the draft {drafter.name!r}, which shares the target's vocabulary"
        raise ValueError(f"draft_prompts is for a draft of another vocabulary (its own ids); this engine has {what}: "
                         "it reads the target's prompt, so pass draft_prompts=None")
    if isinstance(draft_prompts, (str, bytes)) or not isinstance(draft_prompts, Sequence) or len(draft_prompts) != rows:
        n = len(draft_prompts) if isinstance(draft_prompts, Sequence) else type(draft_prompts).__name__
        raise ValueError(f"draft_prompts must be a list of one draft prompt per prompt ({rows}), got {n}")
    V = cross_draft.draft_vocab_size(engine.params.draft)
    Sd = drafter.draft_len(max_len)
    lengths = []
    for i, p in enumerate(draft_prompts):
        arr = np.asarray(p) if isinstance(p, (Sequence, np.ndarray)) and not isinstance(p, (str, bytes)) else None
        if arr is None or arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"draft prompt {i} must be a non-empty flat list of the draft's token ids, got {p!r:.60}")
        if arr.min() < 0 or arr.max() >= V:
            raise ValueError(f"draft prompt {i} has token ids outside the draft's vocabulary [0, {V}) (ids of the "
                             "target's vocabulary? they go in prompts)")
        if arr.size > Sd:
            raise ValueError(f"draft prompt {i} has {arr.size} ids, more than the draft's cache of {Sd} positions "
                             f"(max_len {max_len})")
        lengths.append(arr.size)
    width = min(prompt_width(max(lengths), engine.prompt_bucket), Sd)
    ids_BT = np.zeros((rows, width), np.int32)
    for i, p in enumerate(draft_prompts):
        ids_BT[i, :lengths[i]] = p
    return ids_BT, np.asarray(lengths, np.int32)


def flag_invalid(out: GenerateOutput) -> GenerateOutput:
    """Counts the -1 tokens (rows of NaN / no finite logits, see verify's NAN_POLICY) per request in
    out.stats["invalid_logit_tokens"], and warns when there are any: such output is not to be trusted."""
    counts = [sum(1 for t in tokens if t < 0) for tokens in out.tokens]
    out.stats["invalid_logit_tokens"] = counts
    if any(counts):
        warnings.warn(f"Engine: the target's logits were invalid (NaN, inf, or no finite entry) at {sum(counts)} "
                      f"emitted position(s) of {sum(1 for c in counts if c)} request(s), marked by token -1; "
                      "the text after them is not meaningful (broken weights or inputs?)", RuntimeWarning,
                      stacklevel=3)
    return out
