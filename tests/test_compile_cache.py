"""The persistent compilation cache: a second process with the same shapes loads, not compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, jax
from jax import monitoring
events = {}
monitoring.register_event_listener(lambda name, **kw: events.__setitem__(name, events.get(name, 0) + 1))
import specjax
from specjax.models import Config, random_model
config = Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, rope_theta=10000.0, eos_token_ids=(63,))
engine = specjax.Engine(random_model(config, seed=0), draft="pld", method="fly", k=3, max_new_tokens=6)
tokens = engine.generate([[1, 2, 3, 1, 2]]).tokens
print(json.dumps({"tokens": tokens, "dir": jax.config.jax_compilation_cache_dir,
                  "hits": events.get("/jax/compilation_cache/cache_hits", 0)}))
"""


def run(env_value: str) -> dict:
    env = {**os.environ, "SPECJAX_COMPILATION_CACHE": env_value, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_compiled_program(tmp_path):
    cache = tmp_path / "xla"
    first = run(str(cache))
    assert first["dir"] == str(cache) and first["hits"] == 0
    assert any(p.name.startswith("jit_run") for p in cache.iterdir())  # the generation program was stored
    second = run(str(cache))
    assert second["hits"] >= 1 and second["tokens"] == first["tokens"]


@pytest.mark.heavy
def test_cache_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    off = run("off")
    assert off["dir"] is None and off["hits"] == 0 and not (tmp_path / "xla").exists()
