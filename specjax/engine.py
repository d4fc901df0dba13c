"""`specjax.Engine`: validates a request, then runs the one compiled generation program.

The program itself (prefill + one while_loop of draft, score, verify, commit)
is in `loop.py`; drafters in `drafters.py`; rules in `verify`. This module
turns the public arguments into those static pieces, catches bad input before
compiling, and turns the program's arrays into tokens and statistics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax import _checks, drafters, loop, sharding, verify
from specjax.models.model import Model

_PROMPT_BUCKET = 16  # prompt lengths are padded to a multiple of this to limit recompiles
_CACHE_BUCKET = 64
DRAFTS = ("None", "a Model", "'pld'", "'self:N'", "('pld', Model)")


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # per prompt: the new tokens only, up to and including EOS
    stats: dict[str, Any]
    # the rule's final state: the CSD memory (with what this call taught it), the ASD
    # ledgers f32[B], or (); `generate(..., rule_state=out.rule_state)` carries it on
    rule_state: Any = ()


class Engine:
    """Compiles and runs generation (DESIGN.md's public API).

    draft: None (target-only autoregressive decoding, the baseline), a `Model`
    sharing the target's vocabulary, "pld" (prompt lookup), "self:N" (the
    target's first N layers), or ("pld", Model) (FLy's multi-level drafting).
    method: a `verify` method (greedy/exact, fly, asd, csd, typical, sampling);
    at temperature > 0, greedy/exact verify by lossless speculative sampling.
    Beyond DESIGN.md's arguments: `eos_ids` overrides the tokens that end a row
    (default: the model's EOS; `()` generates exactly max_new_tokens, as benchmarks
    do), `pld_match` ("earliest" or "latest") picks prompt lookup's occurrence, and
    `prompt_bucket` is the multiple the longest prompt is padded to (the program's shapes
    follow from it: a larger bucket compiles fewer programs for prompts of many lengths,
    at the cost of a wider prefill).
    mesh: None (one device), a `jax.sharding.Mesh` with axes ("data", "model"), or a
    `sharding.MeshConfig` (rules, attention "auto"/"replicate"/"pad", draft "shard"/"replicate");
    params are placed once, caches and logits are constrained inside the program, and the
    batch must divide over "data" (see `specjax.sharding`).
    """

    def __init__(self, target: Model, draft=None, method: str = "greedy", k: int = 8,
                 max_new_tokens: int = 128, max_len: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, mesh=None, eos_ids: Sequence[int] | None = None,
                 pld_match: str = "earliest", prompt_bucket: int = _PROMPT_BUCKET, **rule_options):
        if not isinstance(target, Model):
            raise TypeError(f"target must be a specjax.models.Model, got {type(target).__name__}")
        _checks.engine_args(temperature=temperature, top_p=top_p, seed=seed, eos_ids=eos_ids)  # NaN, "12", 1.5
        mesh_config = None if mesh is None else sharding.MeshConfig.of(mesh)  # validated before compiling
        if mesh_config is not None:  # attention="pad": zero heads appended so that they divide the model axis
            target, draft = sharding.prepare_models(mesh_config, target, draft)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if max_len is not None and max_len <= 1:
            raise ValueError(f"max_len must be > 1, got {max_len}")
        if not isinstance(prompt_bucket, (int, np.integer)) or isinstance(prompt_bucket, bool) or prompt_bucket < 1:
            raise ValueError(f"prompt_bucket must be a positive integer, got {prompt_bucket!r}")
        if pld_match not in ("earliest", "latest"):
            raise ValueError(f"pld_match must be 'earliest' or 'latest', got {pld_match!r}")
        if method not in verify.METHODS:
            raise ValueError(f"unknown method {method!r} (supported: {', '.join(verify.METHODS)})")
        self.target, self.method, self.k, self.prompt_bucket = target, method, int(k), int(prompt_bucket)
        self.max_new_tokens, self.max_len = int(max_new_tokens), max_len
        self.temperature, self.top_p, self.seed, self.mesh = float(temperature), float(top_p), seed, mesh
        self.eos_ids = tuple(int(e) for e in (target.eos_token_ids if eos_ids is None else eos_ids))
        self.drafter, self.draft_params = self._drafter(draft, pld_match)
        self.draft = draft
        # mesh: NamedShardings for params, caches and logits (specjax.sharding); None: one device
        self.layout = None if mesh_config is None else sharding.make_layout(
            mesh_config, target.config, getattr(getattr(self.drafter, "model", self.drafter), "config", None))
        if self.drafter is None:
            if method not in ("greedy", "exact") or rule_options:
                what = f"method {method!r}" if method not in ("greedy", "exact") else \
                    f"option(s) {', '.join(sorted(rule_options))}"
                raise ValueError(f"{what} needs a draft: draft=None is target-only decoding")
            self.policy = None
        else:
            if self.top_p < 1.0:
                raise ValueError("top_p < 1 is only supported for target-only decoding (draft=None): "
                                 "speculative sampling preserves the target's full distribution")
            rule = "sampling" if self.temperature > 0 and method in ("greedy", "exact") else method
            try:
                vocab = {} if self.layout is None or self.layout.vocab_sharding is None else \
                    {"vocab_sharding": self.layout.vocab_sharding}
                self.policy = verify.make_policy(rule, k=self.k, temperature=self.temperature, **vocab,
                                                 **rule_options)
            except ValueError as e:
                raise ValueError(str(e).replace("make_policy", "Engine")) from None
            if isinstance(rule_options.get("csd_memory"), verify.CSDMemory):  # a memory of another tokenizer
                verify.check_csd_vocab("Engine", rule_options["csd_memory"], target.config.vocab_size)
        if self.layout is None:
            self._program = jax.jit(loop.generate_program, static_argnums=(0, 1, 2, 3))
            self.placed_params = (target.params, self.draft_params)
        else:  # outputs replicated: every process of a multi-process run reads them
            self._program = jax.jit(loop.generate_program, static_argnums=(0, 1, 2, 3),
                                    out_shardings=self.layout.replicated)
            self.placed_params = (
                sharding.place(target.params, self.layout.param_shardings(target.params)),
                sharding.place(self.draft_params, self.layout.param_shardings(self.draft_params, "draft"))
                if jax.tree.leaves(self.draft_params) else self.draft_params)

    def _drafter(self, draft, pld_match):
        t, k = self.target, self.k
        if draft is None:
            return None, ()
        if isinstance(draft, str) and draft == "pld":
            return drafters.PromptLookup(k, match=pld_match), ()
        if isinstance(draft, str) and draft.startswith("self:"):
            n = draft[len("self:"):]
            if not n.isdigit() or not 1 <= int(n) < t.config.num_layers:
                raise ValueError(f"draft {draft!r}: N must be an integer in [1, {t.config.num_layers - 1}]")
            config = dataclasses.replace(t.config, num_layers=int(n))
            return (drafters.ModelDrafter(config, k, t.dtype, draft),
                    drafters.self_draft_params(t.params, int(n)))
        if isinstance(draft, Model):
            _check_vocab(t, draft)
            return drafters.ModelDrafter(draft.config, k, draft.dtype, draft.name or "draft"), draft.params
        if isinstance(draft, tuple) and len(draft) == 2 and draft[0] == "pld" and isinstance(draft[1], Model):
            _check_vocab(t, draft[1])
            if self.temperature > 0:
                raise ValueError("multi-level drafting ('pld', Model) is a temperature-0 drafter")
            model = drafters.ModelDrafter(draft[1].config, k, draft[1].dtype, draft[1].name or "draft")
            return drafters.MultiLevel(model, drafters.PromptLookup(k, match=pld_match)), draft[1].params
        raise ValueError(f"unknown draft {draft!r:.80}; expected one of {', '.join(DRAFTS)}")

    # -- inputs --------------------------------------------------------------
    def _prepare(self, prompts: Sequence[Sequence[int]], rule_state=None):
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
        width = -(-longest // self.prompt_bucket) * self.prompt_bucket
        if self.max_len is None:  # from the padded width, so that all shapes follow from it
            max_len = -(-(width + needed - longest) // _CACHE_BUCKET) * _CACHE_BUCKET
        else:
            max_len = self.max_len
            if needed > max_len:
                raise ValueError(
                    f"request does not fit the cache: longest prompt {longest} + max_new_tokens "
                    f"{self.max_new_tokens} + k {self.k} + 1 = {needed} > max_len {max_len}")
        _checks.positions("Engine", self.target.config, longest + self.max_new_tokens, "longest prompt + max_new_tokens")
        _checks.cache_fits(_checks.cache_configs(self), self.target.dtype, len(prompts), max_len, self.max_new_tokens)
        T = min(width, max_len)
        prompt_BT = np.zeros((len(prompts), T), np.int32)
        for i, p in enumerate(prompts):
            prompt_BT[i, : lengths[i]] = p
        s = loop.Settings(self.max_new_tokens, max_len, self.temperature, self.top_p, self.eos_ids,
                          self.target.dtype, self.layout)
        static = (self.target.config, s, self.drafter, self.policy)
        state = self._rule_state(len(prompts), rule_state)
        # host arrays: jit transfers them; the PRNG key is made inside the program
        inputs = (prompt_BT, np.asarray(lengths, np.int32), np.uint32(self.seed), state)
        if self.layout is not None:  # rows split over "data" (a batch it does not divide is an error)
            self.layout.check_batch(len(prompts))
            rows = self.layout.spec("rows")
            inputs = sharding.place(inputs, (self.layout.named(rows), self.layout.named(P(rows[0])),
                                             self.layout.replicated,
                                             jax.tree.map(lambda _: self.layout.replicated, state)))
        return static, (*self.placed_params, *inputs)

    def _rule_state(self, batch_size: int, given):
        """The rule's starting state: fresh (`policy.init_state`), or `given`, checked against it."""
        if self.policy is None:
            if given is not None and jax.tree.leaves(given):
                raise ValueError("rule_state was given, but target-only decoding (draft=None) has no rule state")
            return ()
        fresh = jax.device_get(self.policy.init_state(batch_size))  # host arrays, as every other input
        if given is None:
            return fresh
        want, got = jax.tree.structure(fresh), jax.tree.structure(given)
        if want != got:
            raise ValueError(f"rule_state does not match method {self.method!r}'s state: expected the structure "
                             f"{want}, got {got} (pass the rule_state of an earlier output of this engine)")
        given = jax.device_get(given)  # host arrays, like `fresh`: one comparison, one jit cache entry
        for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(given)):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"rule_state does not match method {self.method!r}'s state: an array of "
                                 f"{b.dtype}{list(b.shape)} where {a.dtype}{list(a.shape)} is expected "
                                 + _checks.state_hint(self.method, a, b))
        return given

    # -- public --------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], rule_state=None) -> GenerateOutput:
        """New tokens and statistics for each prompt (one compiled program for the whole batch).

        rule_state: the rule's starting state, e.g. the `rule_state` of an earlier output so
        that CSD's memory keeps what earlier calls taught it (default: the rule's fresh state,
        the memory given at construction)."""
        static, args = self._prepare(prompts, rule_state)
        seq_BS, num_out_B, stats, policy_state = jax.device_get(self._program(*static, *args))
        prompt_len = [len(p) for p in prompts]
        tokens = [seq_BS[b, prompt_len[b]: prompt_len[b] + num_out_B[b]].tolist() for b in range(len(prompts))]
        return _checks.flag_invalid(GenerateOutput(tokens, _stats(stats, policy_state, self.policy), policy_state))

    def lower(self, prompts: Sequence[Sequence[int]], rule_state=None) -> jax.stages.Lowered:
        static, args = self._prepare(prompts, rule_state)
        return self._program.lower(*static, *args)


def _check_vocab(target: Model, draft: Model) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"vocabulary mismatch between draft ({dv} tokens) and target ({tv} tokens): "
                         "a draft model must share the target's tokenizer")
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None and tt.backend.get_vocab() != dt.backend.get_vocab():
        raise ValueError("vocabulary mismatch between draft and target: same size, different tokens")


def _stats(stats, policy_state, policy) -> dict[str, Any]:
    rounds_B, round_tokens_B = stats["rounds_B"], stats["round_tokens_B"]
    # tau per request = tokens emitted by rounds / rounds (SPEC.md, Metrics); a request
    # finished by its prefill token has no round and a tau of 0 by this definition.
    tau_B = np.where(rounds_B > 0, round_tokens_B / np.maximum(rounds_B, 1), 0.0)
    out = {
        "tau": float(tau_B.mean()),
        "tau_per_request": tau_B.tolist(),
        "rounds": int(rounds_B.max()),
        "rounds_per_request": rounds_B.tolist(),
        "round_tokens_per_request": round_tokens_B.tolist(),
    }
    if policy is None:
        return out
    offered, accepted = stats["offered_K"], stats["accepted_K"]
    loose, examined = int(stats["num_loose_B"].sum()), int(stats["examined_B"].sum())
    out.update({
        "accepted_per_round": float(accepted.sum() / max(int(rounds_B.sum()), 1)),
        "accepted_per_position": np.where(offered > 0, accepted / np.maximum(offered, 1), 0.0).tolist(),
        "accepted_counts_per_position": accepted.tolist(),
        "offered_per_position": offered.tolist(),
        "loose": loose,
        "loose_per_request": stats["num_loose_B"].tolist(),
        "mismatches_examined": examined,
        "loose_share": loose / examined if examined else 0.0,
        "ledger_spent_per_request": stats["spent_B"].tolist(),
    })
    if isinstance(policy_state, verify.CSDMemory):
        out["csd_memory_filled"] = int(policy_state.filled)
        out["csd_memory_capacity"] = policy_state.capacity
        out["csd_memory_dropped"] = int(policy_state.dropped)
    return out
