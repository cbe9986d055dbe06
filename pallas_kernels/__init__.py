"""Pallas kernels and their pure-jnp references. Never imports paged_jax."""
