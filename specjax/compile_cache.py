"""JAX's persistent compilation cache, on by default under $SPECJAX_CACHE/xla.

A generation program takes 5-40 s to compile on a CPU; with the cache a second
process with the same shapes loads the executable instead. `SPECJAX_COMPILATION_CACHE`
switches it: unset (on, under the specjax cache directory), "0"/"off" (off), or a
directory. A cache directory the user configured in JAX itself is left alone.
"""

from __future__ import annotations

import os

import jax

ENV_VAR = "SPECJAX_COMPILATION_CACHE"
MIN_COMPILE_SECONDS = 0.5  # smaller programs compile faster than they load
MAX_BYTES = 4 << 30  # least recently used programs are evicted past this


def directory() -> str | None:
    """Where compiled programs are kept, or None when the cache is off."""
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if setting:
        return setting
    from specjax.models import presets

    return os.path.join(presets.cache_dir(), "xla")


def enable() -> str | None:
    """Turns the cache on (unless switched off or already configured); returns its directory."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = directory()
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
