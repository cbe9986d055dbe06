"""Address translation on the host: token position -> (page, offset) -> flat slot. NumPy only.

The same arithmetic as an OS page table: logical page = floor(t / page_size), offset = t mod
page_size, slot = block_table[logical page] * page_size + offset.
"""

from __future__ import annotations

import math

import numpy as np


def pages_needed(num_tokens: int, page_size: int) -> int:
  """ceil(num_tokens / page_size): pages an unshared sequence of that length occupies."""
  return math.ceil(num_tokens / page_size)


def locate(block_table, position: int, page_size: int) -> tuple[int, int]:
  """(physical page, offset) of token `position`: logical page floor(t / B), offset t mod B."""
  logical_page, offset = divmod(int(position), page_size)
  if not 0 <= logical_page < len(block_table):
    raise ValueError(f"position={position} is past the block table's capacity "
                     f"({len(block_table)} pages x page_size={page_size})")
  return int(block_table[logical_page]), offset


def slots_for_positions(block_table, positions, page_size: int) -> np.ndarray:
  """i32[len(positions)] flat slots `page * page_size + offset` of the given token positions."""
  table = np.asarray(block_table, np.int32)
  positions = np.asarray(positions, np.int64)
  if positions.size and (positions.min() < 0 or positions.max() >= table.size * page_size):
    raise ValueError(f"positions {positions.min()}..{positions.max()} fall outside the block "
                     f"table's capacity of {table.size * page_size} tokens")
  return (table[positions // page_size] * page_size + positions % page_size).astype(np.int32)
