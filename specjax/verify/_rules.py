"""The rule objects by method name: each rule's class sits on its own page, beside its
per-sequence function (`_fly.py`: `fly` and `Fly`, ...), and extends `_common.Rule`.

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

Adding a rule: a module with the per-sequence function and its class, and an
entry in RULES. docs/rules.md states every rule and its options.
"""

from __future__ import annotations

import dataclasses

from specjax.verify._asd import Asd
from specjax.verify._common import Round, RoundCounts, Rule, check_temperature  # noqa: F401  (re-exported)
from specjax.verify._csd import Csd
from specjax.verify._fly import Fly
from specjax.verify._greedy import Greedy
from specjax.verify._sampling import Sampling
from specjax.verify._typical import Typical

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


def at_temperature(rule: Rule, temperature) -> Rule:
    """The rule that verifies at `temperature`: exact verification (`Greedy`) becomes lossless
    speculative sampling (`Sampling()`) at T > 0; every other rule stays itself. A temperature that
    is not a finite number >= 0, or a rule that verifies only at T = 0 (ASD, CSD) given T > 0,
    is a ValueError naming it. The engine and the binaries decide by this one function."""
    temperature = check_temperature(type(rule).__name__, temperature)
    if temperature > 0 and isinstance(rule, Greedy):
        rule = Sampling()
    rule.check_temperature(temperature)
    return rule
