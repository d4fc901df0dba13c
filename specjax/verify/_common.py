"""Pieces every acceptance rule shares (docs/rules.md, Notation and Entropy).

`row_stats` is the one place where rules read the logits: every per-row statistic
comes from `gate_stats_reference` below (a few plain jnp lines: the one reference of
these statistics) where the backend says "reference" (the CPU default), from the fused
Pallas kernel `specjax.pallas.gate_stats` where it says "kernel" (the GPU/TPU default;
`Backend.pallas` / `SPECJAX_PALLAS` choose, and the Engine resolves the choice once),
or from `pallas.gate_stats_sharded` when the backend has a `vocab_sharding`; so each
rule keeps the rest of its arithmetic on K-sized vectors. Every rule takes
`backend=None` (`specjax.backend.Backend`) and hands it here.

Checks: the public per-sequence functions (`verify.fly(...)`) check their inputs
(`check_inputs`); a rule object checks its batch once per trace (`check_batch`) and
runs the per-sequence logic on the checked rows without checking them again.

Token choice from logits (`greedy`, `sample`, `tempered`, `top_p_logits`) lives here
too: the loop, the drafters and the rules all choose tokens with it.

(Longer than ~450 lines on purpose: this and a rule's own page are the only files of verify
that one generation runs through, and a split would put one more file on every prompt's path,
tests/test_layering.py::test_one_prompt_path. Its sections: statistics, token choice, checks,
vector helpers, the `Rule` base, FLy's gate.)

Also here: `Rule`, the base of the rule objects (a rule's options and state, for a
batch of rows; each rule's class sits on its own page beside its per-sequence
function), and FLy's entropy gate, which Asd and Csd compose with.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import pallas
from specjax.backend import PLAIN, Backend, VocabSharding  # noqa: F401  (VocabSharding: re-exported by verify)
from specjax.backend import of as backend_of  # a public function's `backend` argument, checked
from specjax.pallas._online import MAX_VOCAB, NEG_INF

ENTROPIES = ("normalized", "top3")

INVALID_TOKEN = -1
NAN_POLICY = """\
Logit rows that hold a NaN or +inf, or no finite entry at all, are invalid: they
name no token. `row_stats` gives them argmax -1, so every rule stops at such a
position (no exact match, and no loose acceptance: the loose tests read NaN
statistics, which pass no comparison) and the token it emits there is -1;
`greedy` and `sample` (below) return -1 for such a row too. The engine
counts the -1 tokens of each request in stats["invalid_logit_tokens"] and warns;
a -1 never silently becomes token 0."""


class Verdict(NamedTuple):
    """What a rule decides for one sequence (int32 scalars; [B] under vmap)."""

    num_accepted: jax.Array  # n: draft tokens committed, 0 <= n <= num_draft
    next_token: jax.Array  # token emitted after d[:n]
    num_loose: jax.Array  # accepted positions that the exact test rejected


class RowStats(NamedTuple):
    """float32 statistics of each row of a [R, V] logits block."""

    max: jax.Array  # f32[R]
    argmax: jax.Array  # i32[R], lowest index on ties
    lse: jax.Array  # f32[R], log-sum-exp
    entropy: jax.Array  # f32[R], nats
    entropy_normalized: jax.Array  # f32[R], entropy / log V clamped to [0, 1]
    entropy_top3: jax.Array  # f32[R], nats over the min(3, V) largest p
    logit_at: jax.Array  # f32[R], logits_RV[r, tokens_R[r]]; NaN for a token outside [0, V)


def vmap(fn, backend=None):
    """jax.vmap over a batch of rows; with `backend.vocab_sharding`, rows sharded on its batch axis.

    On a mesh with Explicit axes, vmap needs every mapped argument's leading axis
    sharded alike: they are placed replicated there (the other axes keep theirs).
    """
    sharding = None if backend is None else backend.vocab_sharding
    if sharding is None:
        return jax.vmap(fn)
    batched = jax.vmap(fn, spmd_axis_name=sharding.batch_axis)
    if jax.sharding.AxisType.Explicit not in sharding.mesh.axis_types:
        return batched

    def place(a):
        spec = tuple(jax.typeof(a).sharding.spec or ())
        spec = spec + (None,) * (a.ndim - len(spec))
        if not spec or spec[0] is None:
            return a
        return jax.reshard(a, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *spec[1:])))

    return lambda *args: batched(*jax.tree.map(place, args))


def row_stats(logits_RV: jax.Array, tokens_R: jax.Array, backend=None, *, checked: bool = False) -> RowStats:
    """Per-row statistics in float32, in one read of the logits.

    logits_RV: float32 or bfloat16 (other floats are cast to float32); tokens_R: int[R].
    Rows need at least one finite logit; -inf logits are legal: they get p = 0 and
    take no part in the entropies. A token outside [0, V) gets logit_at = NaN, so a
    rule never accepts it loosely; rules mask padding past num_draft themselves.
    backend: a `specjax.backend.Backend`, None: the plain one. Its `pallas` says where the
    statistics come from: "reference", `gate_stats_reference` (plain jnp); "kernel", the Pallas
    kernel; None or "auto" (a backend the Engine did not build) is resolved here for the
    platform. With `vocab_sharding`, logits sharded over the vocabulary are reduced shard by
    shard (`pallas.gate_stats_sharded`). checked: the logits passed `check_inputs` or
    `check_batch` (every rule's do), so their shape is not checked again.
    """
    if logits_RV.dtype not in (jnp.float32, jnp.bfloat16):
        logits_RV = logits_RV.astype(jnp.float32)
    tokens_R = tokens_R.astype(jnp.int32)
    backend = (backend or PLAIN) if checked else backend_of(backend)
    impl = backend.pallas
    if impl not in ("kernel", "reference"):  # not resolved (the Engine resolves its backend once)
        impl = pallas.resolve_impl(None, backend)
    if backend.vocab_sharding is not None:
        sharding = backend.vocab_sharding
        stats = RowStats(*pallas.gate_stats_sharded(logits_RV, tokens_R, mesh=sharding.mesh,
                                                    vocab_axis=sharding.vocab_axis, impl=impl, backend=backend,
                                                    checked=checked))
    elif impl == "kernel":
        stats = RowStats(*pallas.gate_stats(logits_RV, tokens_R, impl="kernel", backend=backend, checked=checked))
    else:
        if not checked:
            pallas.check_inputs(logits_RV, tokens_R)
        stats = gate_stats_reference(logits_RV, tokens_R)
    # Invalid rows (a NaN, +inf, or no finite logit) have no argmax: -1, never a draft token, so no rule
    # accepts at that position and a next token read there is -1 (NAN_POLICY).
    valid_R = jnp.isfinite(stats.max) & ~jnp.isnan(stats.lse)
    return stats._replace(argmax=jnp.where(valid_R, stats.argmax, INVALID_TOKEN))


@jax.jit
def gate_stats_reference(logits, tokens=None) -> RowStats:
    """The plain statistics of each row of `logits` [..., V] (float32 or bfloat16; tokens int [...]
    whose logit to report, or None): docs/rules.md's definitions in jnp (softmax, top_k), every
    field with the leading shape of the logits. The argmax of an invalid row is left as it falls
    (`row_stats` masks it). The one reference of these statistics: the CPU path of the rules, and
    what the Pallas kernels are tested against (`pallas.gate_stats_reference` is the kernels' own
    algebra in jnp, a second formulation, not a copy)."""
    x = logits.astype(jnp.float32)
    V = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)
    ms = jnp.where(m == NEG_INF, 0.0, m)
    d = x - ms  # <= 0; -inf entries give exp(d) = 0
    e = jnp.exp(d)
    s = jnp.sum(e, axis=-1)
    log_s = jnp.log(s)
    # H = -sum p log p with p = e / s, log p = d - log s; 0 log 0 = 0.
    entropy = jnp.maximum(log_s - jnp.sum(jnp.where(e > 0, e * d, 0.0), axis=-1) / s, 0.0)
    # normalized: H / log V clamped to [0, 1]; 0 for V = 1; exactly 1 for a uniform row (every
    # exp(x - max) is 1), whatever the compiler makes of log. log V: a correctly rounded constant.
    if V == 1:
        normalized = jnp.zeros_like(entropy)
    else:
        normalized = jnp.where(s == jnp.float32(V), 1.0, jnp.clip(entropy / np.float32(np.log(V)), 0.0, 1.0))
    # top3: -sum p log p over the min(3, V) largest p, log p = (x - max) - log s, clamped at 0.
    top = jax.lax.top_k(x, min(3, V))[0]
    lp = (top - ms) - log_s[..., None]
    top3 = jnp.maximum(-jnp.sum(jnp.where(top == NEG_INF, 0.0, jnp.exp(lp) * lp), axis=-1), 0.0)
    # argmax: the lowest index of the max (a NaN counts as the max), as a compare and a float32
    # min-reduction: XLA:CPU runs them several times faster than jnp.argmax's (value, index) one.
    col = jax.lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)
    argmax = jnp.min(jnp.where((x == m) | jnp.isnan(x), col, jnp.inf), axis=-1).astype(jnp.int32)
    if tokens is None:
        logit_at = jnp.full(x.shape[:-1], jnp.nan, jnp.float32)
    else:
        tok = tokens.astype(jnp.int32)
        picked = jnp.take_along_axis(x, jnp.clip(tok, 0, V - 1)[..., None], axis=-1)[..., 0]
        logit_at = jnp.where((tok >= 0) & (tok < V), picked, jnp.nan)
    return RowStats(m[..., 0], argmax, ms[..., 0] + log_s, entropy, normalized, top3, logit_at)


def entropy_of(stats: RowStats, kind: str) -> jax.Array:
    return stats.entropy_normalized if kind == "normalized" else stats.entropy_top3


# --- token choice from logits (greedy, temperature, top-p): the loop's, the drafters' and the rules' ---


_F32_MAX = float(jnp.finfo(jnp.float32).max)


def tempered(logits_V: jax.Array, temperature: float, axis: int = -1) -> jax.Array:
    """float32 (L - max L) / T: the logits of softmax(L / T), finite-safe at any T > 0.

    Shifting by the row max before scaling keeps the largest entry at exactly 0, so
    a temperature so small that 1 / T or L / T overflows float32 still gives the
    argmax (the distribution then is one-hot in float32): greedy, eagerly and under
    jit alike. The scale is a multiplication by 1 / T clamped to float32's range,
    so XLA cannot rewrite it into 0 * inf.
    """
    x = logits_V.astype(jnp.float32)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted * jnp.float32(min(1.0 / temperature, _F32_MAX))


def _valid(logits_BV: jax.Array) -> jax.Array:
    m_B = jnp.max(logits_BV, axis=-1)  # NaN if any entry is NaN
    return jnp.isfinite(m_B)


def greedy(logits_BV: jax.Array) -> jax.Array:
    """argmax with the lowest index on ties (jnp.argmax's rule), int32[B]; -1 for an invalid row."""
    return jnp.where(_valid(logits_BV), jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), INVALID_TOKEN)


def top_p_logits(logits_BV: jax.Array, top_p: float) -> jax.Array:
    """Masks to -inf every token outside the smallest set whose probability reaches top_p.

    The most probable token always survives; ties at the boundary are all kept
    (the cut is a logit threshold), so the result does not depend on sort order.
    """
    if top_p >= 1.0:
        return logits_BV
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # mass strictly before each sorted position; keep positions whose prior mass < top_p
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_count_B = jnp.maximum(jnp.sum(before_BV < top_p, axis=-1), 1)
    threshold_B = jnp.take_along_axis(sorted_BV, (keep_count_B - 1)[:, None], axis=-1)
    return jnp.where(logits_BV >= threshold_B, logits_BV, -jnp.inf)


def sample(key: jax.Array, logits_BV: jax.Array, temperature: float, top_p: float = 1.0) -> jax.Array:
    """One token per row: greedy at temperature 0, else a sample of softmax(logits / T) within top-p."""
    if temperature == 0.0:
        return greedy(logits_BV)
    scaled = top_p_logits(tempered(logits_BV, temperature), top_p)
    token_B = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(_valid(logits_BV), token_B, INVALID_TOKEN)


# --- input checks: all at trace time, on static shapes and Python values ---


def check_choice(fn: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{fn}: unknown {name}={value!r}; expected one of {', '.join(map(repr, choices))}")


def check_number(fn: str, name: str, value, *, low=None, integer: bool = False, low_open: bool = False) -> None:
    """A finite numeric scalar: a Python number or a (possibly traced) 0-d array.

    A static value must be finite (NaN and inf pass no comparison, so they would
    switch a rule's test off or on silently), >= low (> low with low_open) when
    low is given, and a whole number when `integer`; a traced one is checked for
    its dtype only."""
    try:
        ok = (value is not None and not isinstance(value, bool) and jnp.ndim(value) == 0
              and jnp.issubdtype(jnp.result_type(value), jnp.number))
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{fn}: {name} must be a numeric scalar, got {value!r}")
    if isinstance(value, jax.core.Tracer):
        if integer and not jnp.issubdtype(value.dtype, jnp.integer):
            raise ValueError(f"{fn}: {name} must be an integer, got {value.dtype}")
        return
    x = complex(value) if jnp.iscomplexobj(value) else float(value)
    if isinstance(x, complex) or not math.isfinite(x):
        raise ValueError(f"{fn}: {name} must be a finite number, got {value!r}")
    if integer and x != int(x):
        raise ValueError(f"{fn}: {name} must be a whole number, got {value!r}")
    if low is not None and (x <= low if low_open else x < low):
        raise ValueError(f"{fn}: {name} must be {'>' if low_open else '>='} {low}, got {value!r}")


def check_temperature(fn: str, temperature) -> float:
    """A static, finite temperature >= 0. A tiny T > 0 is kept: `tempered` makes it greedy when
    softmax(L / T) is one-hot in float32."""
    if (not isinstance(temperature, numbers.Real) or isinstance(temperature, bool)
            or not math.isfinite(temperature) or not temperature >= 0):
        raise ValueError(f"{fn}: temperature must be a static, finite Python number >= 0, got {temperature!r}")
    return float(temperature)


def check_inputs(fn: str, draft_tokens, target_logits, num_draft):
    """Validates one sequence's inputs; returns (d_K int32, L_RV, k int32[]).

    L_RV keeps a float32 or bfloat16 dtype (row_stats reads it as stored; a kernel
    then moves half the bytes for bf16); any other float becomes float32. Rule
    arithmetic on L_RV itself casts to float32 (`f32`).
    """
    d_K, L_RV = jnp.asarray(draft_tokens), jnp.asarray(target_logits)
    if d_K.ndim != 1 or not jnp.issubdtype(d_K.dtype, jnp.integer):
        raise ValueError(f"{fn}: draft_tokens must be an int array [K] for one sequence (jax.vmap for a batch), "
                         f"got {d_K.dtype}{list(d_K.shape)}")
    K = d_K.shape[0]
    if K == 0:
        raise ValueError(f"{fn}: K = 0 draft tokens; a round needs K >= 1")
    if L_RV.ndim != 2 or not jnp.issubdtype(L_RV.dtype, jnp.floating):
        raise ValueError(f"{fn}: target_logits must be a float array [K+1, V], got {L_RV.dtype}{list(L_RV.shape)}")
    if L_RV.shape[0] != K + 1:
        raise ValueError(f"{fn}: target_logits has {L_RV.shape[0]} rows, expected K+1 = {K + 1} for K = {K} drafts")
    if L_RV.shape[1] == 0:
        raise ValueError(f"{fn}: target_logits has an empty vocabulary")
    if L_RV.shape[1] >= MAX_VOCAB:  # the kernels' limit (`row_stats` does not check again)
        raise ValueError(f"{fn}: vocabulary size {L_RV.shape[1]} is too large: V must be < {MAX_VOCAB}")
    if L_RV.dtype not in (jnp.float32, jnp.bfloat16):
        L_RV = L_RV.astype(jnp.float32)
    return d_K.astype(jnp.int32), L_RV, num_draft_scalar(fn, num_draft, K)


def check_batch(fn: str, draft_tokens_BK, target_logits_BRV, num_draft_B):
    """Validates a batch of rounds once per trace (what `check_inputs` checks of one row, for all B
    rows at once); returns (d_BK int32, L_BRV, k_B int32 in [0, K]). The per-sequence logic then runs
    on the rows without checking them again."""
    d_BK, L_BRV = jnp.asarray(draft_tokens_BK), jnp.asarray(target_logits_BRV)
    if d_BK.ndim != 2 or not jnp.issubdtype(d_BK.dtype, jnp.integer):
        raise ValueError(f"{fn}: draft_tokens must be [B, K] int, got {d_BK.dtype}{list(d_BK.shape)}")
    B, K = d_BK.shape
    if K == 0:
        raise ValueError(f"{fn}: K = 0 draft tokens; a round needs K >= 1")
    if L_BRV.ndim != 3 or L_BRV.shape[:2] != (B, K + 1):
        raise ValueError(f"{fn}: target_logits must be [B, K+1, V] = [{B}, {K + 1}, V], got {list(L_BRV.shape)}")
    if not jnp.issubdtype(L_BRV.dtype, jnp.floating):
        raise ValueError(f"{fn}: target_logits must be a float array [B, K+1, V], got {L_BRV.dtype}")
    if L_BRV.shape[2] == 0:
        raise ValueError(f"{fn}: target_logits has an empty vocabulary")
    if L_BRV.shape[2] >= MAX_VOCAB:  # the kernels' limit
        raise ValueError(f"{fn}: vocabulary size {L_BRV.shape[2]} is too large: V must be < {MAX_VOCAB}")
    if L_BRV.dtype not in (jnp.float32, jnp.bfloat16):
        L_BRV = L_BRV.astype(jnp.float32)
    if isinstance(num_draft_B, numbers.Integral) and not 0 <= num_draft_B <= K:
        raise ValueError(f"{fn}: num_draft={num_draft_B} outside [0, K = {K}]")
    k_B = per_row(fn, "num_draft", K if num_draft_B is None else num_draft_B, B, None)
    if not jnp.issubdtype(k_B.dtype, jnp.integer):
        raise ValueError(f"{fn}: num_draft must be an int scalar or [B], got {k_B.dtype}")
    return d_BK.astype(jnp.int32), L_BRV, jnp.clip(k_B.astype(jnp.int32), 0, K)


def f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def num_draft_scalar(fn: str, num_draft, K: int) -> jax.Array:
    """num_draft as an int32 scalar in [0, K]; a traced value is clipped into range."""
    if num_draft is None:
        return jnp.int32(K)
    if isinstance(num_draft, numbers.Integral) and not 0 <= num_draft <= K:
        raise ValueError(f"{fn}: num_draft={num_draft} outside [0, K = {K}]")
    k = jnp.asarray(num_draft)
    if k.ndim != 0 or not jnp.issubdtype(k.dtype, jnp.integer):
        raise ValueError(f"{fn}: num_draft must be an int scalar per sequence, got {k.dtype}{list(k.shape)}")
    return jnp.clip(k.astype(jnp.int32), 0, K)


def check_draft_probs(fn: str, draft_probs, K: int, V: int):
    """draft_probs [K, V] as float32, or None for a point mass on each draft."""
    if draft_probs is None:
        return None
    q_KV = jnp.asarray(draft_probs)
    if q_KV.ndim != 2 or q_KV.shape[0] != K:
        raise ValueError(f"{fn}: draft_probs must be [K, V] = [{K}, V], got {list(q_KV.shape)}")
    if q_KV.shape[1] != V:
        raise ValueError(f"{fn}: vocabulary mismatch: draft_probs has V = {q_KV.shape[1]}, target_logits V = {V}")
    return q_KV.astype(jnp.float32)


def check_loose_mask(fn: str, loose_mask, K: int) -> jax.Array:
    """bool[K] veto on loose acceptance (another rule's gate); None allows all."""
    if loose_mask is None:
        return jnp.ones((K,), bool)
    mask_K = jnp.asarray(loose_mask)
    if mask_K.shape != (K,):
        raise ValueError(f"{fn}: loose_mask must be bool[K] = [{K}], got {list(mask_K.shape)}")
    return mask_K.astype(bool)


def check_key(fn: str, key):
    if key is None:
        raise ValueError(f"{fn}: temperature > 0 needs a PRNG key")
    return key


# --- small vector helpers over the K draft positions ---


def padded(d_K: jax.Array) -> jax.Array:
    """Draft tokens extended to K+1 entries so they index the K+1 logit rows."""
    return jnp.concatenate([d_K, jnp.zeros((1,), jnp.int32)])


def valid_mask(K: int, k: jax.Array) -> jax.Array:
    """Positions that hold real drafts; padding past num_draft is never accepted."""
    return jnp.arange(K) < k


def exact_flags(d_K: jax.Array, t_R: jax.Array, k: jax.Array) -> jax.Array:
    """ex[i] = (d[i] == t[i]) on real positions; padding is never a match."""
    K = d_K.shape[0]
    return (d_K == t_R[:K]) & valid_mask(K, k)


def accepted_count(acc_K: jax.Array) -> jax.Array:
    """n = sum(cumprod(acc)): the length of the accepted prefix."""
    return jnp.sum(jnp.cumprod(acc_K.astype(jnp.int32))).astype(jnp.int32)


def count_before(flags_K: jax.Array, n: jax.Array) -> jax.Array:
    """#{i < n : flags[i]}."""
    return jnp.sum(flags_K & (jnp.arange(flags_K.shape[0]) < n)).astype(jnp.int32)


# --- rule objects: the base every rule's class extends ---


class RoundCounts(NamedTuple):
    """Per-row counts of one verify call (0 on inactive rows), for the statistics."""

    num_loose_B: jax.Array  # int32[B]: mismatches accepted loosely
    examined_B: jax.Array  # int32[B]: those plus the mismatch that stopped the round, if any
    spent_B: jax.Array  # float32[B]: ASD ledger charged


class Round(NamedTuple):
    """One verify call's batched inputs, checked once (`check_batch`), as every rule's `_step` receives them."""

    d_BK: jax.Array  # int32[B, K]
    L_BRV: jax.Array  # float[B, R, V], R = K + 1
    k_B: jax.Array  # int32[B]: real drafts per row
    keys_B: Any  # PRNG keys [B], or None at temperature 0
    active_B: jax.Array  # bool[B]
    q_BKV: Any  # float[B, K, V] draft probabilities, or None (point mass)
    temperature: float
    backend: Any = None  # specjax.backend.Backend, handed to the per-sequence logic


def option(default, help_text: str, choices: tuple | None = None):
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
        temperature = check_temperature(fn, temperature)
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
        # the batch is checked here, once per trace: the rule's per-sequence logic runs on checked rows
        d_BK, L_BRV, k_B = check_batch(fn, draft_tokens_BK, target_logits_BRV, num_draft_B)
        B, K, V = L_BRV.shape[0], d_BK.shape[1], L_BRV.shape[2]
        active_B = per_row(fn, "active", True if active_B is None else active_B, B, bool)
        q_BKV = None
        if draft_probs_BKV is not None:
            q_BKV = jnp.asarray(draft_probs_BKV)
            if q_BKV.shape != (B, K, V):
                raise ValueError(f"{fn}: draft_probs must be [B, K, V] = {[B, K, V]} "
                                 f"(vocabulary of the target), got {list(q_BKV.shape)}")
            q_BKV = q_BKV.astype(jnp.float32)
        keys_B = jax.random.split(check_key(fn, key), B) if temperature > 0 else None
        if backend is None:  # plain data from here on: the Engine always passes its own
            backend = PLAIN
        elif not isinstance(backend, Backend):
            raise ValueError(f"{fn}: backend must be a specjax.backend.Backend or None, got {backend!r:.80}")
        verdict, state, spent_B = self._step(state, Round(d_BK, L_BRV, k_B, keys_B, active_B, q_BKV, temperature,
                                                         backend))
        stopped_B = verdict.num_accepted < k_B  # the round ended on a rejected draft
        counts = RoundCounts(jnp.where(active_B, verdict.num_loose, 0),
                             jnp.where(active_B, verdict.num_loose + stopped_B.astype(jnp.int32), 0),
                             jnp.where(active_B, spent_B, 0.0))
        return verdict, state, counts

    def _step(self, state, rnd: Round) -> tuple[Verdict, Any, jax.Array]:
        """(verdict_B, new state, ledger charged f32[B]); a stateless rule verifies row by row."""
        def row(d_K, L_RV, key, q_KV, k):
            return self._row(d_K, L_RV, key, q_KV, k, rnd.temperature, rnd.backend)

        verdict = vmap(row, rnd.backend)(rnd.d_BK, rnd.L_BRV, rnd.keys_B, rnd.q_BKV, rnd.k_B)
        return verdict, state, jnp.zeros(verdict.num_accepted.shape, jnp.float32)

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend) -> Verdict:
        """One checked sequence: the rule's per-sequence logic (stateless rules), without the checks of
        its public function (`check_batch` ran on the batch)."""
        raise NotImplementedError


def per_row(fn, name, value, B, dtype):
    """`value` (a scalar or [B]) broadcast to [B], cast to `dtype` (None: as it is)."""
    x = jnp.asarray(value)
    if x.shape not in ((), (B,)):
        raise ValueError(f"{fn}: {name} must be a scalar or [B] = [{B}], got {list(x.shape)}")
    return jnp.broadcast_to(x if dtype is None else x.astype(dtype), (B,))


# --- FLy's entropy gate, which Asd and Csd compose with ---


def entropy_gate(h_K, theta, rule: str = "paper") -> jax.Array:
    """gate[j] = h[j] >= theta; switched off at theta <= 0 (paper) or <= 0.01 (reference)."""
    off = theta <= (0.0 if rule == "paper" else 0.01)
    return off | (h_K >= theta)


def check_gate(fn, theta, entropy):
    if theta is not None:
        check_number(fn, "theta", theta)
    check_choice(fn, "entropy", entropy, ENTROPIES)


def entropy_gate_BK(theta, entropy, rnd: Round):
    """FLy's gate h[i] >= theta as a loose_mask, or None when theta is unset."""
    if theta is None:
        return None

    def row(d_K, L_RV):
        h_R = entropy_of(row_stats(L_RV, padded(d_K), rnd.backend, checked=True), entropy)
        return entropy_gate(h_R[:-1], theta)

    return vmap(row, rnd.backend)(rnd.d_BK, rnd.L_BRV)
