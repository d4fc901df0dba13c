"""experiments/profile_step.py (its helper in _profile): the profile reads XLA's operations.
(The unrolled layout it times is tested with the engine, tests/test_engine.py.)"""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from experiments import _profile

EXP = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def test_profile_lists_the_programs_operations():
    fn = jax.jit(lambda a, b: jnp.tanh(a @ b).sum())
    ops = _profile.profile_ops(fn, (jnp.ones((64, 64)), jnp.ones((64, 64))), steps=3)
    assert ops and all(ms >= 0 and n > 0 for _, ms, n in ops)
    assert not any(name.startswith("$") for name, _, _ in ops)  # Python frames are not operations


def test_bad_flags_are_refused_before_loading():
    out = subprocess.run([sys.executable, str(EXP / "profile_step.py"), "--context=300", "--cache_len=256"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--context must be below --cache_len" in out.stderr
