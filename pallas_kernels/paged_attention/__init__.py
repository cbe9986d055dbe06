"""Ragged paged attention: the Pallas (Triton) kernel, its pure-jnp reference, the merge rule."""

from pallas_kernels.paged_attention.kernel_triton import BlockSizes, paged_attention
from pallas_kernels.paged_attention.reference import dense_attention, paged_attention_reference

__all__ = ["BlockSizes", "paged_attention", "dense_attention", "paged_attention_reference"]
