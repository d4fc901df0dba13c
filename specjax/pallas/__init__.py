"""Pallas kernels with pure-jnp references."""
