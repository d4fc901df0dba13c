"""experiments/examples/own_decoder.py: a plain-JAX decoder that uses specjax.verify's pure rules.

Its tokens are checked against target-only greedy decoding of the same random target, and
the loose rules against their documented limits (docs/rules.md): fly with theta above 1
and asd with budget 0 are greedy; fly with the gate and window off accepts every draft.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "examples" / "own_decoder.py"
K, MAX_NEW, B = 4, 24, 3


@pytest.fixture(scope="module")
def od():
    spec = importlib.util.spec_from_file_location("own_decoder", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines no absl flags: those are made under __main__ only
    return module


@pytest.fixture(scope="module")
def setup(od):
    params = od.make_target(0)
    prompt_BT = od.make_prompts(B, 16, 0)
    reference = np.asarray(od.greedy_decode(params, prompt_BT, max_new_tokens=MAX_NEW))
    return params, od.make_draft(params, 0.1, 1), prompt_BT, reference


def test_greedy_verification_is_target_only_greedy_in_fewer_forwards(od, setup):
    params, draft_params, prompt_BT, reference = setup
    out = od.run(params, draft_params, prompt_BT, method="greedy", k=K, max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(out["tokens"], reference)
    assert (out["num_out_B"] == MAX_NEW).all() and (out["loose_B"] == 0).all()
    # The prefill emits the first token; rounds emit the rest, n + 1 each.
    assert (out["round_tokens_B"] == MAX_NEW - 1).all()
    assert (out["rounds_B"] < MAX_NEW - 1).all() and out["tau"] > 1.2  # the draft model does agree


def test_fly_limits(od, setup):
    params, draft_params, prompt_BT, reference = setup
    strict = od.run(params, draft_params, prompt_BT, method="fly", k=K, max_new_tokens=MAX_NEW, theta=1.5, window=1)
    np.testing.assert_array_equal(strict["tokens"], reference)
    assert (strict["loose_B"] == 0).all()
    # Gate off (theta <= 0) and no window: every draft is kept, so each round emits K + 1.
    everything = od.run(params, draft_params, prompt_BT, method="fly", k=K, max_new_tokens=MAX_NEW, theta=0.0,
                        window=0)
    assert (everything["rounds_B"] == math.ceil((MAX_NEW - 1) / (K + 1))).all()
    assert (everything["loose_B"] > 0).all() and not (everything["tokens"] == reference).all()
    # A gate and a window in between let some mismatches through, not all.
    some = od.run(params, draft_params, prompt_BT, method="fly", k=K, max_new_tokens=MAX_NEW, theta=0.3, window=1)
    assert 0 < some["loose_B"].sum() < everything["loose_B"].sum()


def test_asd_ledger_is_carried_across_rounds(od, setup):
    params, draft_params, prompt_BT, reference = setup
    strict = od.run(params, draft_params, prompt_BT, method="asd", k=K, max_new_tokens=MAX_NEW, budget=0.0, gate=1.0)
    np.testing.assert_array_equal(strict["tokens"], reference)
    assert (strict["loose_B"] == 0).all() and (strict["ledger_B"] == 0).all()
    loose = od.run(params, draft_params, prompt_BT, method="asd", k=K, max_new_tokens=MAX_NEW, budget=2.0, gate=1.0,
                   block_cap=2)
    assert (loose["loose_B"] > 0).all()
    # Charged only for accepted mismatches, never below zero, one ledger per request for the whole run.
    assert ((loose["ledger_B"] >= 0) & (loose["ledger_B"] < 2.0)).all()
    assert loose["tau"] > strict["tau"]


def test_report_prints_tokens_and_tau(od, setup):
    # What `python experiments/examples/own_decoder.py` prints (main only adds the flags).
    params, draft_params, prompt_BT, reference = setup
    lines = od.report(params, draft_params, prompt_BT, method="greedy", k=K, max_new_tokens=MAX_NEW)
    assert lines[0] == f"row 0: {reference[0].tolist()}"
    assert sum("same as target-only greedy" in line for line in lines) == B
    assert lines[-1].startswith(f"method greedy, K = {K}: tau ") and float(lines[-1].split()[-1]) > 1.2
