"""Deviceless AOT compilation for TPU topologies (`specjax.aot`, experiments/aot_compile.py).

Tests marked `tpu_aot` need libtpu (`pip install -e .[tpu-aot]`) and compile for a TPU
topology on this CPU host; the others check the dispatcher and the error messages.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.backend import Backend
from specjax import aot, models, pallas
from specjax.models import Config
from specjax.pallas import _dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason='needs libtpu: pip install -e ".[tpu-aot]"')
TINY = Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
              head_dim=16)


def test_compiled_mosaic_variant_is_allowed_when_compiling_for_tpu():
    with pytest.raises(ValueError, match="interpret mode"):
        _dispatch.check_compiled_variant("mosaic", interpret=False)
    tpu = Backend(platform="tpu")
    assert _dispatch.accelerator(tpu) == "tpu" and pallas.target_platform(tpu) == "tpu"
    _dispatch.check_compiled_variant("mosaic", False, tpu)
    assert _dispatch.resolve_impl(None, tpu) == "kernel" and _dispatch.resolve_interpret(None, tpu) is False
    assert _dispatch.resolve_variant(None, tpu) == "mosaic"
    with pytest.raises(ValueError, match="does not compile on tpu"):
        _dispatch.check_compiled_variant("triton", False, tpu)
    assert pallas.target_platform() == "cpu"
    with pytest.raises(ValueError, match="platform must be"):
        Backend(platform="tpuv9")


def test_libtpu_missing_prints_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"libtpu is not installed.*pip install.*tpu-aot.*libtpu==") as e:
        aot.topology_mesh("v5e:2x2")
    assert "0.0." in str(e.value)  # the version the installed jax pins, from its metadata


def test_unknown_topology_names_are_refused_before_libtpu():
    with pytest.raises(aot.TopologyError, match="unknown TPU generation 'v9x'"):
        aot.topology_mesh("v9x:2x2")
    with pytest.raises(aot.TopologyError, match="expected GENERATION:AxB"):
        aot.topology_mesh("v5e-8")


@pytest.mark.tpu_aot
@needs_libtpu
def test_tiny_speculative_program_compiles_for_v5e_with_mosaic_kernels():
    mesh = aot.topology_mesh("v5e:2x2", (2, 2))
    target, draft = models.abstract(TINY, jnp.bfloat16), models.abstract(TINY, jnp.bfloat16)
    engine = specjax.Engine(target, draft=("pld", draft), method="fly", k=4, max_new_tokens=16, max_len=64,
                            mesh=mesh, eos_ids=())
    report = aot.compile_report(engine, [[1] * 8] * 4, "v5e:2x2")
    assert report.compiled and report.fits and report.chips == 4
    assert report.mosaic_kernels >= 1  # the vocabulary-sharded gate statistics, compiled by Mosaic
    # bf16 parameters of target and draft split over the model axis (2), but for the replicated norm scales
    norms = TINY.num_layers * TINY.hidden_size * 2 + TINY.hidden_size
    assert report.params_bytes == 2 * 2 * ((TINY.num_params() - norms) // 2 + norms)
    assert report.argument_bytes >= report.params_bytes and report.temp_bytes >= report.cache_bytes
    # inside the vocabulary-sharded shard_map the mesh's devices (TPU) already choose Mosaic, even
    # whatever the backend's platform; a program on the host's CPU devices has none (the jnp reference)
    assert aot.count_mosaic_kernels(engine.lower([[1] * 8] * 4).as_text()) == report.mosaic_kernels
    import jax
    cpu = specjax.Engine(models.abstract(TINY, jnp.bfloat16), draft=("pld", models.abstract(TINY, jnp.bfloat16)),
                         method="fly", k=4, max_new_tokens=16, max_len=64, eos_ids=(),
                         mesh=jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4]))
    assert aot.count_mosaic_kernels(cpu.lower([[1] * 8] * 4).as_text()) == 0


@pytest.mark.tpu_aot
@needs_libtpu
def test_wide_tensor_parallel_program_compiles_for_v5e():
    """8 query heads / 2 KV heads on 8 chips of "model": one KV head per chip (repeated), as counted."""
    wide = Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=16)
    mesh = aot.topology_mesh("v5e:2x4")
    engine = specjax.Engine(models.abstract(wide, jnp.bfloat16), draft=("pld", models.abstract(wide, jnp.bfloat16)),
                            method="fly", k=4, max_new_tokens=16, max_len=64, mesh=mesh, eos_ids=())
    assert engine.target.config.num_kv_heads == 8 and engine.layout.target.attention_sharded
    report = aot.compile_report(engine, [[1] * 8] * 4, "v5e:2x4")
    assert report.compiled and report.fits and report.chips == 8 and report.mosaic_kernels >= 1
    hand = aot.hand_count(wide, 8, 1, 4, 64, 2)
    assert report.params_bytes == 2 * hand["params"] and report.cache_bytes == 2 * hand["cache"]


@pytest.mark.tpu_aot
@needs_libtpu
@pytest.mark.parametrize("method, mesh_shape", [
    ("asd", (2, 2)), pytest.param("asd", (4, 1), marks=pytest.mark.heavy),
    pytest.param("csd", (1, 4), marks=pytest.mark.heavy)])
def test_kernels_outside_shard_map_compile_on_a_multi_chip_mesh(method, mesh_shape):
    """ASD's regret-prefix kernel (and the gate statistics where the vocabulary is not split)
    run outside the vocabulary shard_map: the engine wraps them in a replicated one
    (`Backend.mesh`), since the partitioner cannot split a Mosaic call across chips."""
    mesh = aot.topology_mesh("v5e:2x2", mesh_shape)
    engine = specjax.Engine(models.abstract(TINY, jnp.bfloat16), draft="pld", method=method, k=4,
                            max_new_tokens=16, max_len=64, mesh=mesh, eos_ids=())
    report = aot.compile_report(engine, [[1] * 8] * 4, "v5e:2x2")
    assert report.compiled and report.fits
    assert report.mosaic_kernels >= (2 if method == "asd" else 1)


@pytest.mark.tpu_aot
@needs_libtpu
def test_topology_errors():
    with pytest.raises(aot.TopologyError, match=r"mesh 2,4 does not match topology 'v5e:2x2': it has 4 chips"):
        aot.topology_mesh("v5e:2x2", (2, 4))
    with pytest.raises(aot.TopologyError, match="unknown topology 'v5e:3x7'"):
        aot.topology_mesh("v5e:3x7")


@pytest.mark.tpu_aot
@needs_libtpu
@pytest.mark.parametrize("flags, message", [
    (["--topology=v5e:9x9x9x9"], "unknown topology"),
    (["--topology=v5e:2x2", "--mesh=2,4"], "does not match topology"),
    (["--topology=v5e:2x2", "--model=llama-9"], "unknown model 'llama-9'"),
    (["--topology=v5e:2x2", "--model=smollm2-135m-instruct", "--draft=pld", "--attention=repeat_kv"],
     "9 query heads / 3 KV heads cannot be placed on a model axis of 4"),
])
def test_binary_errors_are_clear(flags, message):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "aot_compile.py"), *flags],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


def test_count_mosaic_kernels():
    compiled = 'x = custom-call(a), custom_call_target="tpu_custom_call"\ny = custom-call(b), custom_call_target="foo"'
    assert aot.count_mosaic_kernels(compiled) == 1
    assert aot.count_mosaic_kernels('%0 = stablehlo.custom_call @tpu_custom_call(%a)') == 1
    assert np.isclose(aot._bytes("20.73", "G"), 20.73 * 2 ** 30, rtol=1e-9)


@pytest.mark.parametrize("target,draft", [("llama-3.1-70b", "llama-3.2-1b"), ("llama-3.1-405b", "llama-3.1-8b")])
def test_hand_count_matches_the_plan_of_the_real_pairs(target, draft):
    """The AOT table's hand counts (docs/wide_tp.md) are the plan's bytes per device, on (1, 8) and (2, 4)."""
    import jax

    from specjax import sharding
    from specjax.models import catalog

    for data, tp in ((1, 8), (2, 4)):
        engine = specjax.Engine(models.abstract(target, jnp.bfloat16), draft=models.abstract(draft, jnp.bfloat16),
                                method="fly", k=8, max_new_tokens=8, max_len=512, eos_ids=(),
                                mesh=jax.make_mesh((data, tp), ("data", "model")))
        report = sharding.memory_report(engine, 8, 512)
        for key, name in (("target", target), ("draft", draft)):
            hand = aot.hand_count(catalog.config(name), tp, data, 8, 512, 2)
            assert report[f"{key}_params"] == hand["params"] and report[f"{key}_cache"] == hand["cache"], key


def test_405b_has_its_published_size():
    from specjax.models import catalog

    c = catalog.config("llama-3.1-405b")
    assert c.num_params() == 405_853_388_800  # meta-llama/Llama-3.1-405B: 405.85 B
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size) == (126, 16384, 128, 8, 53248)
    assert c.rope_scaling.factor == 8.0 and c.rope_theta == 500000.0 and not c.tie_embeddings
