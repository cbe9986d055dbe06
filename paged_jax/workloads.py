"""Synthetic serving workloads: request lengths and arrival times (no dataset is downloaded).

The length generators are the fits in ../shared/WORKLOADS.md (checked there on 2 million draws):

- ShareGPT-like: input ~ 0.755 LogNormal(3.180, 0.992) + 0.245 LogNormal(6.243, 0.813), output ~
  Weibull(shape 1.142, scale 357.8); pairs with input + output > max_total are redrawn (never
  clipped: clipping shifts the means). Means 161.5 / 335.6 at max_total = 2048.
- Alpaca-like: input ~ 6 + LogNormal(2.26, 0.811), redrawn outside [6, 508]; output ~
  Weibull(1.022, 58.9), redrawn above 1470; independent. Means 19.3 / 58.4.

Continuous draws are rounded to the nearest integer and floored at 1. Arrivals: Poisson at a rate
(exponential gaps), as in the PagedAttention paper; rate = inf puts every request at t = 0.
Host side, NumPy only.
"""

from __future__ import annotations

import math

import numpy as np

WORKLOADS = ("sharegpt", "alpaca")


def _round(x: np.ndarray) -> np.ndarray:
  return np.maximum(np.rint(x), 1).astype(np.int64)


def _weibull(rng: np.random.Generator, shape: float, scale: float, n: int) -> np.ndarray:
  return scale * (-np.log(rng.random(n))) ** (1 / shape)


def _sharegpt(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
  first = rng.random(n) < 0.755
  log_in = np.where(first, rng.normal(3.180, 0.992, n), rng.normal(6.243, 0.813, n))
  return _round(np.exp(log_in)), _round(_weibull(rng, 1.142, 357.8, n))


def _alpaca(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
  return _round(6 + np.exp(rng.normal(2.26, 0.811, n))), _round(_weibull(rng, 1.022, 58.9, n))


def sample_lengths(rng: np.random.Generator, workload: str, n: int,
                   max_total: int = 2048) -> tuple[np.ndarray, np.ndarray]:
  """(input lengths, output lengths), i64[n] each, for `workload` in WORKLOADS.

  Args:
    max_total: largest input + output (the model's context); pairs beyond it are redrawn.
  """
  if workload not in WORKLOADS:
    raise ValueError(f"workload={workload!r} is not one of {WORKLOADS}")
  if max_total < 2:
    raise ValueError(f"max_total={max_total} must be >= 2")
  draw = _sharegpt if workload == "sharegpt" else _alpaca
  inputs, outputs = [], []
  have = 0
  for _ in range(10_000):
    i, o = draw(rng, max(2 * (n - have), 64))
    ok = i + o <= max_total
    if workload == "alpaca":
      ok &= (i <= 508) & (o <= 1470)
    inputs.append(i[ok])
    outputs.append(o[ok])
    have += int(ok.sum())
    if have >= n:
      return np.concatenate(inputs)[:n], np.concatenate(outputs)[:n]
  raise ValueError(f"max_total={max_total} accepts too few {workload} draws")


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
  """f64[n] arrival times (s) of a Poisson process at `rate` requests/s; all 0 for rate = inf."""
  if not rate > 0:
    raise ValueError(f"request rate={rate} must be > 0 (inf = all at once)")
  if math.isinf(rate):
    return np.zeros(n)
  return np.cumsum(rng.exponential(1 / rate, n))


def random_prompts(rng: np.random.Generator, lengths, vocab_size: int,
                   low: int = 0) -> list[list[int]]:
  """Token ids uniform in [low, vocab_size), one prompt per length."""
  return [rng.integers(low, vocab_size, int(n)).tolist() for n in lengths]
