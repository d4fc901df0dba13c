"""Rules as objects: each acceptance rule, its options and its state, for a batch of rows.

    rule = verify.Fly(theta=0.2, window=4)         # options checked here, once
    state = rule.init_state(batch_size)            # (), ASD ledgers f32[B], or a CSD memory
    verdict_B, state, counts = rule(state, drafts_BK, logits_BRV, num_draft_B=k_B, key=key,
                                    active_B=live_B, draft_probs_BKV=None, temperature=0.0)

A rule is a frozen, keyword-only dataclass of static options, so it is hashable
and can be a static argument of `jax.jit` (the engine's program holds one).
Calling it vmaps the per-sequence function of its module (`verify.fly`, ...)
over the rows; the per-sequence functions stay the public surface for other
decoders. `RoundCounts` has the same fields for every rule, so the engine never
special-cases one. Inactive rows (active_B False) charge no ledger and teach
the memory nothing.

Composition: Asd and Csd accept FLy's entropy gate (theta, entropy): a mismatch
may then be loosely accepted only where h[i] >= theta, checked before ASD
charges its regret or CSD reads its memory.

Adding a rule: a module with the per-sequence function, a class here, and an
entry in RULES. docs/rules.md states every rule and its options.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from specjax import backend as _backend
from specjax.verify import _asd, _common, _csd, _csd_memory, _fly, _greedy, _sampling, _typical
from specjax.verify._common import Verdict


class RoundCounts(NamedTuple):
    """Per-row counts of one verify call (0 on inactive rows), for the statistics."""

    num_loose_B: jax.Array  # int32[B]: mismatches accepted loosely
    examined_B: jax.Array  # int32[B]: those plus the mismatch that stopped the round, if any
    spent_B: jax.Array  # float32[B]: ASD ledger charged


class Round(NamedTuple):
    """One verify call's batched inputs, as every rule's `_step` receives them."""

    d_BK: jax.Array  # int32[B, K]
    L_BRV: jax.Array  # float[B, R, V], R = K + 1
    k_B: jax.Array  # int32[B]: real drafts per row
    keys_B: Any  # PRNG keys [B], or None at temperature 0
    active_B: jax.Array  # bool[B]
    q_BKV: Any  # float[B, K, V] draft probabilities, or None (point mass)
    temperature: float
    backend: Any = None  # specjax.backend.Backend (None: plain), handed to the per-sequence functions


def _field(default, help_text: str, choices: tuple | None = None):
    """An option: its help text (and choices) feed the experiment binaries' flags."""
    return dataclasses.field(default=default, metadata={"help": help_text, "choices": choices})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """Base of the rule objects: options as fields, checked at construction."""

    name: ClassVar[str]  # the method name
    sampling: ClassVar[bool] = False  # defined at temperature > 0

    def __init_subclass__(cls, *, name: str, sampling: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name, cls.sampling = name, sampling

    def __post_init__(self):
        fn = type(self).__name__
        for name, value in self.options().items():
            try:
                hash(value)
            except TypeError:
                raise ValueError(f"{fn}: option {name}={value!r} must be a static, hashable value "
                                 "(a Python number or string)") from None
        self.check(fn)

    def check(self, fn: str) -> None:
        """Raises ValueError naming a bad option."""

    def check_temperature(self, temperature) -> float:
        fn = type(self).__name__
        temperature = _common.check_temperature(fn, temperature)
        if temperature > 0 and not self.sampling:
            hint = "; at T > 0 lossless verification is verify.Sampling()" if self.name == "greedy" else ""
            raise ValueError(f"{fn}: method {self.name!r} is a temperature-0 rule; got temperature={temperature}"
                             f"{hint}")
        return temperature

    def init_state(self, batch_size: int) -> Any:
        """The rule's state for a fresh batch of `batch_size` rows."""
        return ()

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __call__(self, state, draft_tokens_BK, target_logits_BRV, *, num_draft_B=None, key=None, active_B=None,
                 draft_probs_BKV=None, temperature: float = 0.0, backend=None) -> tuple[Verdict, Any, RoundCounts]:
        """Verifies a batch; returns (Verdict of [B] arrays, new state, RoundCounts).

        key is split per row and used only at temperature > 0. backend: a
        `specjax.backend.Backend` (the engine's program passes its own), None: plain.
        """
        fn = f"{type(self).__name__}()"
        temperature = self.check_temperature(temperature)
        d_BK, L_BRV = jnp.asarray(draft_tokens_BK), jnp.asarray(target_logits_BRV)
        if d_BK.ndim != 2:
            raise ValueError(f"{fn}: draft_tokens must be [B, K], got {list(d_BK.shape)}")
        B, K = d_BK.shape
        if L_BRV.ndim != 3 or L_BRV.shape[:2] != (B, K + 1):
            raise ValueError(f"{fn}: target_logits must be [B, K+1, V] = [{B}, {K + 1}, V], got {list(L_BRV.shape)}")
        k_B = _per_row(fn, "num_draft", K if num_draft_B is None else num_draft_B, B, jnp.int32)
        active_B = _per_row(fn, "active", True if active_B is None else active_B, B, bool)
        q_BKV = None
        if draft_probs_BKV is not None:
            q_BKV = jnp.asarray(draft_probs_BKV)
            if q_BKV.shape != (B, K, L_BRV.shape[2]):
                raise ValueError(f"{fn}: draft_probs must be [B, K, V] = {[B, K, L_BRV.shape[2]]} "
                                 f"(vocabulary of the target), got {list(q_BKV.shape)}")
        keys_B = jax.random.split(_common.check_key(fn, key), B) if temperature > 0 else None
        verdict, state, spent_B = self._step(state, Round(d_BK, L_BRV, k_B, keys_B, active_B, q_BKV, temperature,
                                                         _backend.of(backend)))
        stopped_B = verdict.num_accepted < k_B  # the round ended on a rejected draft
        counts = RoundCounts(jnp.where(active_B, verdict.num_loose, 0),
                             jnp.where(active_B, verdict.num_loose + stopped_B.astype(jnp.int32), 0),
                             jnp.where(active_B, spent_B, 0.0))
        return verdict, state, counts

    def _step(self, state, rnd: Round) -> tuple[Verdict, Any, jax.Array]:
        """(verdict_B, new state, ledger charged f32[B]); a stateless rule verifies row by row."""
        def row(d_K, L_RV, key, q_KV, k):
            return self._row(d_K, L_RV, key, q_KV, k, rnd.temperature, rnd.backend)

        verdict = _common.vmap(row, rnd.backend)(rnd.d_BK, rnd.L_BRV, rnd.keys_B, rnd.q_BKV, rnd.k_B)
        return verdict, state, jnp.zeros(verdict.num_accepted.shape, jnp.float32)

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend) -> Verdict:
        """One sequence: the rule's per-sequence function (stateless rules)."""
        raise NotImplementedError


def _per_row(fn, name, value, B, dtype):
    x = jnp.asarray(value)
    if x.shape not in ((), (B,)):
        raise ValueError(f"{fn}: {name} must be a scalar or [B] = [{B}], got {list(x.shape)}")
    return jnp.broadcast_to(x.astype(dtype), (B,))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Greedy(Rule, name="greedy"):
    """Exact verification ("greedy", also "exact"): output identical to the target's greedy decoding."""

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend):
        return _greedy.greedy(d_K, L_RV, num_draft=k, backend=backend)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling(Rule, name="sampling", sampling=True):
    """Lossless speculative sampling (T > 0; greedy at T = 0)."""

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend):
        return _sampling.speculative_sampling(d_K, L_RV, key, draft_probs=q_KV, temperature=temperature, num_draft=k,
                                              backend=backend)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Typical(Rule, name="typical", sampling=True):
    """Medusa's typical acceptance (a baseline; greedy at T = 0)."""
    epsilon: float = _field(0.09, "typical: epsilon")
    delta: float = _field(0.3, "typical: delta")

    def check(self, fn):
        _typical.check_options(fn, epsilon=self.epsilon, delta=self.delta)

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend):
        return _typical.typical(d_K, L_RV, key, epsilon=self.epsilon, delta=self.delta, temperature=temperature,
                                num_draft=k, backend=backend)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fly(Rule, name="fly", sampling=True):
    """FLy: a mismatch passes where the target is unsure (entropy gate) and the next W drafts match."""
    theta: float = _field(0.3, "fly: entropy threshold (also gates asd/csd when set)")
    window: int = _field(6, "fly: deferred window W")
    entropy: str = _field("normalized", "fly: entropy kind", _common.ENTROPIES)
    rule: str = _field("paper", "fly: paper | reference (the published code)", _fly.RULES)

    def check(self, fn):
        _common.check_number(fn, "theta", self.theta)
        _fly.check_options(fn, theta=self.theta, window=self.window, entropy=self.entropy, rule=self.rule)

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend):
        return _fly.fly(d_K, L_RV, theta=self.theta, window=self.window, entropy=self.entropy, rule=self.rule,
                        temperature=temperature, draft_probs=q_KV, key=key, num_draft=k, backend=backend)


def _check_gate(fn, theta, entropy):
    if theta is not None:
        _common.check_number(fn, "theta", theta)
    _common.check_choice(fn, "entropy", entropy, _common.ENTROPIES)


def _entropy_gate_BK(theta, entropy, rnd: Round):
    """FLy's gate h[i] >= theta as a loose_mask, or None when theta is unset."""
    if theta is None:
        return None

    def row(d_K, L_RV):
        h_R = _common.entropy_of(_common.row_stats(L_RV, _common.padded(d_K), rnd.backend), entropy)
        return _fly.entropy_gate(h_R[:-1], theta)

    return _common.vmap(row, rnd.backend)(rnd.d_BK, rnd.L_BRV)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Asd(Rule, name="asd"):
    """ASD: mismatches paid from a per-request regret budget (the state: one ledger per row)."""
    budget: float = _field(8.0, "asd: request-level regret budget")
    gate: float = _field(0.25, "asd: per-mismatch regret gate g")
    block_cap: int = _field(2, "asd: loose mismatches per block m")
    suffix: str = _field("count", "asd: suffix weight", _asd.SUFFIXES)
    theta: float | None = _field(None, "entropy gate on loose acceptance (unset: off)")
    entropy: str = _field("normalized", "entropy kind of the gate", _common.ENTROPIES)

    def check(self, fn):
        _asd.check_options(fn, gate=self.gate, block_cap=self.block_cap, suffix=self.suffix)
        _common.check_number(fn, "budget", self.budget)
        if self.budget < 0:
            raise ValueError(f"{fn}: budget must be >= 0, got {self.budget}")
        _check_gate(fn, self.theta, self.entropy)

    def init_state(self, batch_size):
        return jnp.full((batch_size,), self.budget, jnp.float32)

    def _step(self, ledger_B, rnd):
        def row(d, L, budget_left, k, mask):
            return _asd.asd(d, L, budget_left, gate=self.gate, block_cap=self.block_cap, suffix=self.suffix,
                            num_draft=k, loose_mask=mask, backend=rnd.backend)

        mask_BK = _entropy_gate_BK(self.theta, self.entropy, rnd)
        verdict, left_B = _common.vmap(row, rnd.backend)(rnd.d_BK, rnd.L_BRV, ledger_B, rnd.k_B, mask_BK)
        left_B = jnp.where(rnd.active_B, left_B, ledger_B)
        return verdict, left_B, ledger_B - left_B


@dataclasses.dataclass(frozen=True, kw_only=True)
class Csd(Rule, name="csd"):
    """CSD: a mismatch passes when the memory has seen the pair often and the target finds it close.

    The memory is the rule's state: `init_state` gives an empty one of `capacity`
    pairs; a calibrated one is passed as starting state (`Engine.generate(rule_state=)`).
    """
    min_count: int = _field(6, "csd: memory count a pair must exceed (lambda)")
    tau: float = _field(0.01, "csd: consistency threshold (log-probability gap >= log tau)")
    update: bool = _field(True, "csd: update the memory online")
    capacity: int = _field(1 << 16, "csd: pairs an empty memory holds")
    theta: float | None = _field(None, "entropy gate on loose acceptance (unset: off)")
    entropy: str = _field("normalized", "entropy kind of the gate", _common.ENTROPIES)

    def check(self, fn):
        _csd.check_options(fn, min_count=self.min_count, tau=self.tau, update=self.update)
        if not isinstance(self.capacity, numbers.Integral) or isinstance(self.capacity, bool) or self.capacity < 1:
            raise ValueError(f"{fn}: capacity must be an int >= 1, got {self.capacity!r}")
        _check_gate(fn, self.theta, self.entropy)

    def init_state(self, batch_size):
        return _csd_memory.csd_memory(self.capacity)

    def _step(self, memory, rnd):
        verdict, memory = _csd.csd_batch(rnd.d_BK, rnd.L_BRV, memory, min_count=self.min_count, tau=self.tau,
                                         update=self.update, num_draft=rnd.k_B, active=rnd.active_B,
                                         loose_mask=_entropy_gate_BK(self.theta, self.entropy, rnd), backend=rnd.backend)
        return verdict, memory, jnp.zeros(verdict.num_accepted.shape, jnp.float32)


RULES: dict[str, type[Rule]] = {cls.name: cls for cls in (Greedy, Sampling, Typical, Fly, Asd, Csd)}
ALIASES = {"exact": "greedy"}
METHODS = tuple(sorted([*RULES, *ALIASES]))


def rule(method: str, **options) -> Rule:
    """The rule object of a method name (greedy/exact, sampling, typical, fly, asd, csd) and its
    options; an unknown option, or one of another method, is an error naming it."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    cls = RULES[ALIASES.get(method, method)]
    own = {f.name for f in dataclasses.fields(cls)}
    for option in options:
        if option not in own:
            owners = [m for m, c in RULES.items() if option in {f.name for f in dataclasses.fields(c)}]
            if not owners:
                known = sorted({f.name for c in RULES.values() for f in dataclasses.fields(c)})
                raise ValueError(f"unknown rule option {option!r}; known options: {', '.join(known)}")
            raise ValueError(f"option {option!r} does not apply to method {method!r} (it is for {', '.join(owners)})")
    return cls(**options)
