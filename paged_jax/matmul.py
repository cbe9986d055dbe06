"""The model's matrix multiplications: one function every projection, MLP and LM head calls.

`dot_general` is `jax.lax.dot_general` with two CPU-measured rules for 2-byte floats (bf16 /
f16), neither of which changes f32 programs:

- **Accumulate and emit f32, then cast back** (`preferred_element_type=f32`). XLA:CPU lowers a
  bf16 x bf16 -> f32 dot to its library kernel (YNNPACK: `__ynn_fusion` in the compiled program)
  that reads bf16 as it is, but a bf16 x bf16 ->
  bf16 dot to converts of both operands (the whole weight, every call) and an f32 dot.
  `python -m experiments.matmul_floor` on SmolLM2-135M's shapes, jax 0.10.2, 2 threads:
  [4560x576]x[576x1536] 251 -> 434 GFLOP/s (f32: 336), [32x576]x[576x49152] 35 -> 278 GFLOP/s
  (f32: 176); jax 0.11 / 0.12 got faster plain bf16 dots, and this route matches them there.
  The result equals a bf16 dot that accumulates in f32 and rounds once, as torch's does.
- **Never a single row**: a bf16 [1, k] x [k, n] dot takes the slow path even with f32 output
  (SmolLM2's LM head at batch 1: 47 ms; padded to 2 rows 4.5 ms), so a one-row lhs is padded to two
  rows and the pad row dropped. Rows are independent, so the kept row is unchanged.

Anything faster found later (an FFI call into a library, another layout) goes behind this same
function, with `jax.lax.dot_general` as the reference the tests compare against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """`jax.lax.dot_general` (flax's `dot_general` signature); result in the operands' dtype.

  For bf16 / f16 operands the product is accumulated and emitted in f32 and cast back once; a
  2-d lhs with a single row is padded to two rows first (see the module docstring).
  """
  dt = jnp.result_type(lhs, rhs)
  if preferred_element_type is not None or dt not in _NARROW:
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
  (lhs_contract, _), (lhs_batch, _) = dimension_numbers
  one_row = lhs.ndim == 2 and lhs.shape[0] == 1 and not lhs_batch and tuple(lhs_contract) == (1,)
  if one_row:
    lhs = jnp.concatenate([lhs, lhs], axis=0)
  out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                            preferred_element_type=jnp.float32).astype(dt)
  return out[:1] if one_row else out


def matmul(x, w):
  """x: [..., k] @ w: [k, n] -> [..., n] through `dot_general`."""
  lead = x.shape[:-1]
  out = dot_general(x.reshape(-1, x.shape[-1]), w, (((1,), (0,)), ((), ())))
  return out.reshape(*lead, w.shape[-1])
