"""The policy layer: every rule and its state behind one interface for the engine.

    policy = verify.make_policy(method, k=8, temperature=0.0, **rule_options)
    state = policy.init_state(batch_size)            # a pytree the while_loop carries
    verdict_B, state, info = policy.verify(state, draft_tokens_BK, target_logits_BKV,
                                           num_draft_B, key, active_B, draft_probs_BKV=None)

A Policy is a frozen, hashable dataclass, so it can be a static argument of
jit. Its state is () for stateless rules, the per-request ASD ledger f32[B],
or the batch-shared CSD memory. `info` has the same keys for every method
(per-row num_loose, examined, spent) so the engine never special-cases rules.
Inactive rows (active_B False) charge no ledger and teach the memory nothing.

Vocabulary-sharded logits: `make_policy(..., vocab_sharding=VocabSharding(mesh,
"model", batch_axis="data"))` makes `verify` read the logits with
`pallas.gate_stats_sharded` (see `_common.use_vocab_sharding`).

Composition: asd and csd accept FLy's entropy gate (options theta, entropy):
a mismatch may then be loosely accepted only where h[i] >= theta, checked
before ASD charges its regret or CSD reads its memory.

Adding a rule: one module with the rule, one `_Rule` entry in RULES.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from specjax.verify import _asd, _common, _csd, _csd_memory, _fly, _greedy, _sampling, _typical
from specjax.verify._common import Verdict, VocabSharding
from specjax.verify._csd_memory import CSDMemory


class Round(NamedTuple):
    """One verify call's batched inputs, as every rule's step receives them."""

    d_BK: jax.Array  # int32[B, K]
    L_BRV: jax.Array  # float[B, K+1, V]
    k_B: jax.Array  # int32[B]
    keys_B: Any  # PRNG keys [B], or None at temperature 0
    active_B: jax.Array  # bool[B]
    q_BKV: Any  # float[B, K, V] draft probabilities, or None (point mass)


@dataclasses.dataclass(frozen=True, eq=False)
class _ByIdentity:
    """Makes a prebuilt memory a hashable option: equal only to itself, never stale under jit."""

    value: Any


@dataclasses.dataclass(frozen=True)
class _Rule:
    defaults: dict[str, Any]
    check: Callable[[str, dict], None]  # (fn, options) -> raises ValueError
    step: Callable[..., tuple[Verdict, Any, jax.Array]]  # (opts, T, state, Round) -> (verdict_B, state, spent_B)
    init: Callable[[dict, int], Any] = lambda opts, B: ()
    sampling: bool = False  # defined at temperature > 0


# --- per-rule steps: vmap the one-sequence rule over the batch ---


def _no_spend(verdict):
    return jnp.zeros(verdict.num_accepted.shape, jnp.float32)


def _greedy_step(opts, T, state, rnd):
    verdict = _common.vmap(lambda d, L, k: _greedy.greedy(d, L, num_draft=k))(rnd.d_BK, rnd.L_BRV, rnd.k_B)
    return verdict, state, _no_spend(verdict)


def _sampling_step(opts, T, state, rnd):
    def row(d, L, key, q, k):
        return _sampling.speculative_sampling(d, L, key, draft_probs=q, temperature=T, num_draft=k)

    verdict = _common.vmap(row)(rnd.d_BK, rnd.L_BRV, rnd.keys_B, rnd.q_BKV, rnd.k_B)
    return verdict, state, _no_spend(verdict)


def _typical_step(opts, T, state, rnd):
    def row(d, L, key, k):
        return _typical.typical(d, L, key, epsilon=opts["epsilon"], delta=opts["delta"], temperature=T, num_draft=k)

    verdict = _common.vmap(row)(rnd.d_BK, rnd.L_BRV, rnd.keys_B, rnd.k_B)
    return verdict, state, _no_spend(verdict)


def _fly_step(opts, T, state, rnd):
    def row(d, L, key, q, k):
        return _fly.fly(d, L, theta=opts["theta"], window=opts["window"], entropy=opts["entropy"],
                        rule=opts["rule"], temperature=T, draft_probs=q, key=key, num_draft=k)

    verdict = _common.vmap(row)(rnd.d_BK, rnd.L_BRV, rnd.keys_B, rnd.q_BKV, rnd.k_B)
    return verdict, state, _no_spend(verdict)


def _entropy_gate_BK(opts, rnd):
    """FLy's gate h[i] >= theta as a loose_mask, or None when the option is off."""
    if opts["theta"] is None:
        return None

    def row(d_K, L_RV):
        h_R = _common.entropy_of(_common.row_stats(L_RV, _common.padded(d_K)), opts["entropy"])
        return _fly.entropy_gate(h_R[:-1], opts["theta"])

    return _common.vmap(row)(rnd.d_BK, rnd.L_BRV)


def _asd_step(opts, T, ledger_B, rnd):
    def row(d, L, budget_left, k, mask):
        return _asd.asd(d, L, budget_left, gate=opts["gate"], block_cap=opts["block_cap"], suffix=opts["suffix"],
                        num_draft=k, loose_mask=mask)

    verdict, left_B = _common.vmap(row)(rnd.d_BK, rnd.L_BRV, ledger_B, rnd.k_B, _entropy_gate_BK(opts, rnd))
    left_B = jnp.where(rnd.active_B, left_B, ledger_B)
    return verdict, left_B, ledger_B - left_B


def _csd_step(opts, T, memory, rnd):
    verdict, memory = _csd.csd_batch(rnd.d_BK, rnd.L_BRV, memory, min_count=opts["min_count"], tau=opts["tau"],
                                     update=opts["update"], num_draft=rnd.k_B, active=rnd.active_B,
                                     loose_mask=_entropy_gate_BK(opts, rnd))
    return verdict, memory, _no_spend(verdict)


# --- option checks, run once by make_policy (the rules re-check at trace time) ---


def _check_gate(fn, opts):
    if opts["theta"] is not None:
        _common.check_number(fn, "theta", opts["theta"])
    _common.check_choice(fn, "entropy", opts["entropy"], _common.ENTROPIES)


def _check_asd(fn, opts):
    _asd.check_options(fn, gate=opts["gate"], block_cap=opts["block_cap"], suffix=opts["suffix"])
    _common.check_number(fn, "budget", opts["budget"])
    if opts["budget"] < 0:
        raise ValueError(f"{fn}: budget must be >= 0, got {opts['budget']}")
    _check_gate(fn, opts)


def _check_csd(fn, opts):
    _csd.check_options(fn, min_count=opts["min_count"], tau=opts["tau"], update=opts["update"])
    memory = opts["csd_memory"]
    if isinstance(memory, _ByIdentity):
        _csd_memory.check_memory(fn, memory.value)
    elif not isinstance(memory, numbers.Integral) or isinstance(memory, bool) or memory < 1:
        raise ValueError(f"{fn}: csd_memory must be a capacity (int >= 1) or a CSDMemory, got {memory!r}")
    _check_gate(fn, opts)


def _csd_init(opts, B):
    memory = opts["csd_memory"]
    return memory.value if isinstance(memory, _ByIdentity) else _csd_memory.csd_memory(memory)


_GATE = {"theta": None, "entropy": "normalized"}  # FLy's entropy gate, off by default

RULES: dict[str, _Rule] = {
    "greedy": _Rule({}, lambda fn, o: None, _greedy_step),
    "sampling": _Rule({}, lambda fn, o: None, _sampling_step, sampling=True),
    "typical": _Rule({"epsilon": 0.09, "delta": 0.3}, lambda fn, o: _typical.check_options(fn, **o),
                     _typical_step, sampling=True),
    "fly": _Rule({"theta": 0.3, "window": 6, "entropy": "normalized", "rule": "paper"},
                 lambda fn, o: _fly.check_options(fn, **o), _fly_step, sampling=True),
    "asd": _Rule({"budget": 8.0, "gate": 0.25, "block_cap": 2, "suffix": "count", **_GATE}, _check_asd, _asd_step,
                 init=lambda opts, B: jnp.full((B,), opts["budget"], jnp.float32)),
    "csd": _Rule({"min_count": 6, "tau": 0.01, "update": True, "csd_memory": 1 << 16, **_GATE}, _check_csd,
                 _csd_step, init=_csd_init),
}
ALIASES = {"exact": "greedy"}
METHODS = tuple(sorted([*RULES, *ALIASES]))


@dataclasses.dataclass(frozen=True)
class Policy:
    """A verification rule with static settings; build it with make_policy."""

    method: str  # canonical name: "exact" becomes "greedy"
    k: int
    temperature: float
    options: tuple[tuple[str, Any], ...]  # every option of the method, defaults filled in
    vocab_sharding: VocabSharding | None = None  # logits sharded over V on a mesh (None: not)

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    def init_state(self, batch_size: int):
        """The rule's state for a fresh batch: (), the ASD ledger f32[B], or the CSD memory."""
        return RULES[self.method].init(self.opts, batch_size)

    def verify(self, state, draft_tokens_BK, target_logits_BKV, num_draft_B=None, key=None, active_B=None,
               draft_probs_BKV=None) -> tuple[Verdict, Any, dict[str, jax.Array]]:
        """Verifies a batch; returns (Verdict of [B] arrays, new state, info of per-row arrays).

        info["num_loose"] int32[B]: loosely accepted mismatches; info["examined"]
        int32[B]: those plus the mismatch that stopped the round, if any (SPEC.md,
        loose share); info["spent"] float32[B]: ASD ledger charged. All 0 on
        inactive rows. key is split per row and used only at temperature > 0.
        """
        fn = f"verify[{self.method}]"
        d_BK, L_BRV = jnp.asarray(draft_tokens_BK), jnp.asarray(target_logits_BKV)
        if d_BK.ndim != 2 or d_BK.shape[1] != self.k:
            raise ValueError(f"{fn}: draft_tokens must be [B, k] = [B, {self.k}], got {list(d_BK.shape)}")
        B = d_BK.shape[0]
        if L_BRV.ndim != 3 or L_BRV.shape[:2] != (B, self.k + 1):
            raise ValueError(f"{fn}: target_logits must be [B, k+1, V] = [{B}, {self.k + 1}, V], "
                             f"got {list(L_BRV.shape)}")
        k_B = _per_row(fn, "num_draft", self.k if num_draft_B is None else num_draft_B, B, jnp.int32)
        active_B = _per_row(fn, "active", True if active_B is None else active_B, B, bool)
        q_BKV = None
        if draft_probs_BKV is not None:
            q_BKV = jnp.asarray(draft_probs_BKV)
            if q_BKV.shape != (B, self.k, L_BRV.shape[2]):
                raise ValueError(f"{fn}: draft_probs must be [B, k, V] = {[B, self.k, L_BRV.shape[2]]} "
                                 f"(vocabulary of the target), got {list(q_BKV.shape)}")
        keys_B = None
        if self.temperature > 0:
            keys_B = jax.random.split(_common.check_key(fn, key), B)
        rnd = Round(d_BK, L_BRV, k_B, keys_B, active_B, q_BKV)
        sharded = self.vocab_sharding is not None  # else an enclosing use_vocab_sharding applies
        with _common.use_vocab_sharding(self.vocab_sharding) if sharded else contextlib.nullcontext():
            verdict, state, spent_B = RULES[self.method].step(self.opts, self.temperature, state, rnd)
        stopped_B = verdict.num_accepted < k_B  # the round ended on a rejected draft
        info = {
            "num_loose": jnp.where(active_B, verdict.num_loose, 0),
            "examined": jnp.where(active_B, verdict.num_loose + stopped_B.astype(jnp.int32), 0),
            "spent": jnp.where(active_B, spent_B, 0.0),
        }
        return verdict, state, info


def _per_row(fn, name, value, B, dtype):
    x = jnp.asarray(value)
    if x.shape not in ((), (B,)):
        raise ValueError(f"{fn}: {name} must be a scalar or [B] = [{B}], got {list(x.shape)}")
    return jnp.broadcast_to(x.astype(dtype), (B,))


def make_policy(method: str, *, k: int, temperature: float = 0.0, vocab_sharding: VocabSharding | None = None,
                **rule_options) -> Policy:
    """Builds the Policy of `method` (greedy, exact, sampling, typical, fly, asd, csd).

    rule_options are the method's options (defaults filled in); an unknown
    option, or one of another method, is an error. At temperature 0,
    sampling and typical are greedy; asd and csd are temperature-0 rules.
    vocab_sharding: a VocabSharding when the target logits are sharded over the
    vocabulary on a mesh (the statistics are then reduced per shard), or None.
    """
    fn = "make_policy"
    if method not in METHODS:
        raise ValueError(f"{fn}: unknown method {method!r}; expected one of {', '.join(METHODS)}")
    name = ALIASES.get(method, method)
    rule = RULES[name]
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{fn}: k must be an int >= 1, got {k!r}")
    temperature = _common.check_temperature(fn, temperature)
    if temperature > 0 and not rule.sampling:
        hint = "; at T > 0 lossless verification is method 'sampling'" if name == "greedy" else ""
        raise ValueError(f"{fn}: method {method!r} is a temperature-0 rule; got temperature={temperature}{hint}")
    known = {o for r in RULES.values() for o in r.defaults}
    for option in rule_options:
        if option not in known:
            raise ValueError(f"{fn}: unknown rule option {option!r}; known options: {', '.join(sorted(known))}")
        if option not in rule.defaults:
            owners = ", ".join(m for m, r in RULES.items() if option in r.defaults)
            raise ValueError(f"{fn}: option {option!r} does not apply to method {method!r} (it is for {owners})")
    opts = {**rule.defaults, **rule_options}
    if isinstance(opts.get("csd_memory"), CSDMemory):
        opts["csd_memory"] = _ByIdentity(opts["csd_memory"])
    rule.check(f"{fn}({method!r})", opts)
    for option, value in opts.items():
        try:
            hash(value)
        except TypeError:
            raise ValueError(f"{fn}: option {option}={value!r} must be a static, hashable value "
                             "(a Python number or string)") from None
    if vocab_sharding is not None and not isinstance(vocab_sharding, VocabSharding):
        raise ValueError(f"{fn}: vocab_sharding must be a verify.VocabSharding or None, got {vocab_sharding!r}")
    return Policy(name, int(k), temperature, tuple(sorted(opts.items())), vocab_sharding)
