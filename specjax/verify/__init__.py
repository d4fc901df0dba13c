"""Acceptance rules (SPEC.md): pure, jit-able, vmap-friendly functions."""
