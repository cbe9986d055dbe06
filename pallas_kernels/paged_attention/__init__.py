"""Ragged paged attention: pure-jnp reference (and, on GPU, the Pallas kernel)."""

from pallas_kernels.paged_attention.reference import dense_attention, paged_attention_reference

__all__ = ["dense_attention", "paged_attention_reference"]
