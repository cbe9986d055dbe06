"""Contiguous per-request allocators: the baselines of the PagedAttention paper (Orca-style).

Each request reserves one contiguous extent of token slots at admission:
  max     the model's maximum length (e.g. 2,048);
  pow2    the next power of two of the request's final length;
  oracle  exactly the final length (knows the future; a lower bound on reservation).
Extents are placed first-fit in a linear slot space, so external fragmentation is real too:
enough free slots in total may still not hold one extent. Python only, nothing traced.
"""

from __future__ import annotations

import bisect
from typing import Hashable

POLICIES = ("max", "pow2", "oracle")


def reservation(policy: str, final_len: int, max_len: int) -> int:
  """Token slots a request with `final_len` tokens reserves under `policy`."""
  if policy == "max":
    return max_len
  if policy == "pow2":
    return 1 << max(0, (final_len - 1).bit_length())
  if policy == "oracle":
    return final_len
  raise ValueError(f"policy={policy!r} is not one of {POLICIES}")


class ContiguousAllocator:
  """First-fit contiguous extents over `capacity_tokens` slots, one extent per request.

  Args:
    capacity_tokens: slots in the whole pool.
    policy: one of POLICIES.
    max_len: the model's maximum sequence length (the `max` reservation, and a cap on requests).
  """

  def __init__(self, capacity_tokens: int, policy: str, max_len: int):
    if policy not in POLICIES:
      raise ValueError(f"policy={policy!r} is not one of {POLICIES}")
    self.capacity_tokens = capacity_tokens
    self.policy = policy
    self.max_len = max_len
    self._free: list[tuple[int, int]] = [(0, capacity_tokens)]   # sorted (start, length)
    self._extents: dict[Hashable, tuple[int, int]] = {}          # seq -> (start, length)
    self._stored: dict[Hashable, int] = {}

  def extent_size(self, final_len: int, num_seqs: int = 1) -> int:
    """Slots a request reserves: `num_seqs` (samples or beams) times its policy's reservation."""
    return num_seqs * reservation(self.policy, final_len, self.max_len)

  def fits(self, final_len: int, num_seqs: int = 1) -> bool:
    """Whether `admit` would find a free extent now."""
    size = self.extent_size(final_len, num_seqs)
    return any(length >= size for _, length in self._free)

  def admit(self, seq_id, prompt_len: int, final_len: int, num_seqs: int = 1) -> bool:
    """Reserves the request's extent (one extent of `num_seqs` reservations for a request with
    several samples or beams); False (nothing changed) if no free extent is large enough."""
    if seq_id in self._extents:
      raise ValueError(f"sequence {seq_id!r} is already admitted")
    if not 0 < prompt_len <= final_len <= self.max_len:
      raise ValueError(f"need 0 < prompt_len={prompt_len} <= final_len={final_len} <= "
                       f"max_len={self.max_len}")
    if num_seqs < 1:
      raise ValueError(f"num_seqs={num_seqs} must be >= 1")
    size = self.extent_size(final_len, num_seqs)
    for i, (start, length) in enumerate(self._free):
      if length >= size:
        if length == size:
          del self._free[i]
        else:
          self._free[i] = (start + size, length - size)
        self._extents[seq_id] = (start, size)
        self._stored[seq_id] = prompt_len
        return True
    return False

  def append(self, seq_id, num_tokens: int = 1) -> None:
    """Stores more tokens inside the request's reservation."""
    if seq_id not in self._extents:
      raise KeyError(f"unknown or finished sequence {seq_id!r}")
    stored = self._stored[seq_id] + num_tokens
    if stored > self._extents[seq_id][1]:
      raise ValueError(f"sequence {seq_id!r} would store {stored} tokens in a reservation of "
                       f"{self._extents[seq_id][1]}")
    self._stored[seq_id] = stored

  def __contains__(self, seq_id) -> bool:
    return seq_id in self._extents

  def free(self, seq_id) -> None:
    """Returns the extent, merging it with free neighbours."""
    if seq_id not in self._extents:
      raise KeyError(f"unknown or finished sequence {seq_id!r}")
    start, length = self._extents.pop(seq_id)
    del self._stored[seq_id]
    i = bisect.bisect(self._free, (start, length))
    self._free.insert(i, (start, length))
    merged = []
    for s, n in self._free:
      if merged and merged[-1][0] + merged[-1][1] == s:
        merged[-1] = (merged[-1][0], merged[-1][1] + n)
      else:
        merged.append((s, n))
    self._free = merged

  def stats(self) -> dict[str, float]:
    stored = sum(self._stored.values())
    reserved = sum(n for _, n in self._extents.values())
    free = sum(n for _, n in self._free)
    largest = max((n for _, n in self._free), default=0)
    return {"stored_tokens": stored, "reserved_token_slots": reserved,
            "internal_fragmentation": (reserved - stored) / reserved if reserved else 0.0,
            "free_token_slots": free, "largest_free_extent": largest,
            "external_fragmentation": 1 - largest / free if free else 0.0}
