"""csd (Calibrated Speculative Decoding): a correction memory plus a consistency gate.

A mismatch (d, t) is loosely accepted when the memory has seen it more than
min_count times and the target's logit of d is within log(tau) of its max.
Counts are read from the table as at the start of the round (docs/rules.md
shows this equals the sequential scan), so the rule is a gather, a prefix scan and a
scatter-add. Temperature 0 only.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp

from specjax.verify import _common, _csd_memory
from specjax.verify._common import Verdict
from specjax.verify._csd_memory import CSDMemory


def check_options(fn: str, *, min_count, tau, update, temperature=0.0) -> None:
    # min_count = -1 is the memory-off ablation (count > -1 always: the tau gate alone decides);
    # counts are whole numbers, so anything else below 0 or fractional is a mistake.
    _common.check_number(fn, "min_count", min_count, low=-1, integer=True)
    _common.check_number(fn, "tau", tau, low=0)  # compared in log space
    if not isinstance(update, bool):
        raise ValueError(f"{fn}: update must be a static bool, got {update!r}")
    if _common.check_temperature(fn, temperature) > 0:
        raise ValueError(f"{fn}: CSD is a temperature-0 rule; got temperature={temperature}")


def _decide(d_K, L_RV, memory, k, allowed_K, *, min_count, tau, backend):
    """One checked sequence against the start-of-round table: (Verdict, pairs int32[K, 2], reached bool[K])."""
    K = d_K.shape[0]
    stats = _common.row_stats(L_RV, _common.padded(d_K), backend, checked=True)
    t_K = stats.argmax[:K]
    ex_K = _common.exact_flags(d_K, stats.argmax, k)
    mis_K = _common.valid_mask(K, k) & ~ex_K
    count_K = _csd_memory.lookup(memory, d_K, t_K)
    # L[i][t[i]] is the row max.
    consistent_K = stats.logit_at[:K] - stats.max[:K] >= jnp.log(jnp.float32(tau))
    valid_K = t_K >= 0  # a row that names no target token (NaN / no finite logit) is never accepted or learnt
    ok_K = (count_K > min_count) & consistent_K & allowed_K & valid_K
    n = _common.accepted_count(ex_K | (mis_K & ok_K))
    # The scan reaches the loosely accepted mismatches and the one that stopped it.
    reached_K = mis_K & (jnp.arange(K) <= n) & valid_K
    return Verdict(n, stats.argmax[n], _common.count_before(mis_K, n)), jnp.stack([d_K, t_K], -1), reached_K


def csd(draft_tokens, target_logits, memory: CSDMemory, *, min_count=6, tau=0.01, update=True,
        num_draft=None, loose_mask=None, temperature=0.0, backend=None) -> tuple[Verdict, CSDMemory]:
    """CSD verification of one sequence; returns (Verdict, memory with this round's increments).

    draft_tokens int[K], target_logits float[K+1, V]. loose_mask bool[K]
    (optional) lets another rule veto loose acceptance, as in asd.
    """
    fn = "csd"
    check_options(fn, min_count=min_count, tau=tau, update=update, temperature=temperature)
    _csd_memory.check_memory(fn, memory)
    d_K, L_RV, k = _common.check_inputs(fn, draft_tokens, target_logits, num_draft)
    verdict, pairs_K2, reached_K = _decide(d_K, L_RV, memory, k, _common.check_loose_mask(fn, loose_mask, d_K.shape[0]),
                                           min_count=min_count, tau=tau, backend=_common.backend_of(backend))
    if update:
        memory = _csd_memory.add(memory, pairs_K2, reached_K)
    return verdict, memory


def csd_batch(draft_tokens_BK, target_logits_BKV, memory: CSDMemory, *, min_count=6, tau=0.01, update=True,
              num_draft=None, active=None, loose_mask=None, temperature=0.0,
              backend=None) -> tuple[Verdict, CSDMemory]:
    """CSD for a batch sharing one memory: every row reads the start-of-round table.

    num_draft int[] or int[B]; active bool[B] (rows that add no increments when
    False); loose_mask bool[B, K]. All increments are added after the round,
    new pairs in row-major order, so a full table drops the later ones.
    """
    fn = "csd_batch"
    check_options(fn, min_count=min_count, tau=tau, update=update, temperature=temperature)
    _csd_memory.check_memory(fn, memory)
    d_BK, L_BRV = jnp.asarray(draft_tokens_BK), jnp.asarray(target_logits_BKV)
    if d_BK.ndim != 2 or L_BRV.ndim != 3 or L_BRV.shape[0] != d_BK.shape[0]:
        raise ValueError(f"{fn}: expected draft_tokens [B, K] and target_logits [B, K+1, V], "
                         f"got {list(d_BK.shape)} and {list(L_BRV.shape)}")
    d_BK, L_BRV, k_B = _common.check_batch(fn, d_BK, L_BRV, num_draft)
    B, K = d_BK.shape
    active_B = jnp.broadcast_to(_batch_arg(fn, "active", True if active is None else active, B), (B,))
    mask_BK = jnp.ones((B, K), bool) if loose_mask is None else jnp.asarray(loose_mask)
    if mask_BK.shape != (B, K):
        raise ValueError(f"{fn}: loose_mask must be bool[B, K] = [{B}, {K}], got {list(mask_BK.shape)}")
    return _batch(d_BK, L_BRV, memory, k_B, active_B, mask_BK.astype(bool), min_count=min_count, tau=tau,
                  update=update, backend=_common.backend_of(backend))


def _batch(d_BK, L_BRV, memory, k_B, active_B, mask_BK, *, min_count, tau, update, backend):
    """CSD on a checked batch sharing one memory (`csd_batch` without its checks)."""
    B, K = d_BK.shape

    def row(d_K, L_RV, k, mask_K):
        return _decide(d_K, L_RV, memory, k, mask_K, min_count=min_count, tau=tau, backend=backend)

    verdict, pairs_BK2, reached_BK = _common.vmap(row, backend)(d_BK, L_BRV, k_B, mask_BK)
    if update:
        inc_BK = reached_BK & active_B[:, None]
        memory = _csd_memory.add(memory, pairs_BK2.reshape(B * K, 2), inc_BK.reshape(B * K))
    return verdict, memory


def _batch_arg(fn, name, value, B):
    x = jnp.asarray(value)
    if x.shape not in ((), (B,)):
        raise ValueError(f"{fn}: {name} must be a scalar or [B] = [{B}], got {list(x.shape)}")
    return x


@dataclasses.dataclass(frozen=True, kw_only=True)
class Csd(_common.Rule, name="csd"):
    """CSD: a mismatch passes when the memory has seen the pair often and the target finds it close.

    The memory is the rule's state: `init_state` gives an empty one of `capacity`
    pairs; a calibrated one is passed as starting state (`Engine.generate(rule_state=)`).
    """
    min_count: int = _common.option(6, "csd: memory count a pair must exceed (lambda)")
    tau: float = _common.option(0.01, "csd: consistency threshold (log-probability gap >= log tau)")
    update: bool = _common.option(True, "csd: update the memory online")
    capacity: int = _common.option(1 << 16, "csd: pairs an empty memory holds")
    theta: float | None = _common.option(None, "entropy gate on loose acceptance (unset: off)")
    entropy: str = _common.option("normalized", "entropy kind of the gate", _common.ENTROPIES)

    def check(self, fn):
        check_options(fn, min_count=self.min_count, tau=self.tau, update=self.update)
        if not isinstance(self.capacity, numbers.Integral) or isinstance(self.capacity, bool) or self.capacity < 1:
            raise ValueError(f"{fn}: capacity must be an int >= 1, got {self.capacity!r}")
        _common.check_gate(fn, self.theta, self.entropy)

    def init_state(self, batch_size):
        return _csd_memory.csd_memory(self.capacity)

    def _step(self, memory, rnd):
        mask_BK = _common.entropy_gate_BK(self.theta, self.entropy, rnd)
        verdict, memory = _batch(rnd.d_BK, rnd.L_BRV, memory, rnd.k_B, rnd.active_B,
                                 jnp.ones(rnd.d_BK.shape, bool) if mask_BK is None else mask_BK, min_count=self.min_count,
                                 tau=self.tau, update=self.update, backend=rnd.backend)
        return verdict, memory, jnp.zeros(verdict.num_accepted.shape, jnp.float32)
