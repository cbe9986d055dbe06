"""A step plan -> padded NumPy arrays for the device (`step.Batch` / `step.DecodeState`).

Shapes are padded to buckets so each compiles once: rows and sample rows to powers of two
(`next_pow2`; at least 8 decode rows, 4 prefill rows, and as many sample rows as rows), prefill
tokens to `token_bucket` (powers of two from 16 up to 64, then four steps an octave up to 256
and eight above, so a 144-token prompt pads to 160 and a 4,560-token prefill to 4,608, not
8,192), block-table width to a power of two of at least 64 columns (`table_width`: attention
work follows seq_lens, not the width, so a wide table costs only its int32s), the prefill
chunks' max_q_len to a power of two >= 64 (of the longest chunk; on the C++ CPU kernel, which
ignores it, of the token bucket: `ProgramLimits.q_from_tokens`). Every distinct shape is
a compile (~1-3 s on this CPU); the floors keep a varied workload to a couple of dozen programs. Layout of a mixed step (see `state.AttentionMetadata.num_decode`):
decode rows first, one token each (padded to a power of two), then the prefill chunks' tokens.
A padding decode row reads and writes slot 0 of NULL_PAGE; padding prefill rows are empty.
NumPy only: the engine does the one `device_put`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from paged_jax.host.addressing import slots_for_positions
from paged_jax.host.block_manager import BlockManager
from paged_jax.host.scheduler import StepPlan
from paged_jax.sampling import SamplingArrays
from paged_jax.state import NULL_PAGE


def next_pow2(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum)."""
  return 1 << max(0, (max(n, minimum) - 1).bit_length())


def token_bucket(n: int, minimum: int = 16) -> int:
  """Padded token count: a power of two up to 64; then a multiple of 1/8 of the next power of two
  up to 256 (four programs an octave: 80, 96, 112, 128, 160, ..., 256; at most 25% padding);
  then a multiple of 1/16 (eight an octave; at most 12.5%).

  Why the middle octaves are split: a server's first token is one step that prefills a prompt,
  and that step costs by its padded tokens. ShareGPT-like prompts reach 132 tokens at the 90th
  percentile, which padded to 256 as powers of two. SmolLM2-135M f32 on 2 cores, one prompt
  beside 4 decode rows: a 144-token prompt's step took 294-299 ms padded to 256 and 194-200 ms
  padded to 160 (`python -m experiments.mixed_step_bench --scan_layers --variants=onednn`;
  results page, issue 30). The cost: six more token buckets, so more programs per decode
  bucket."""
  p = next_pow2(n, minimum)
  if p <= 64:
    return p
  granule = p // 8 if p <= 256 else p // 16
  return -(-n // granule) * granule


MIN_TABLE_WIDTH = 64   # block-table columns at least (or the model's whole context if less)
MIN_Q_BUCKET = 64      # max_q_len of prefill chunks at least (one attention tile)
MIN_DECODE_ROWS = 8    # decode rows at least, past one (`decode_bucket`)
MIN_PREFILL_ROWS = 4
MIN_PREFILL_TOKENS = 16
# 16, not 64: one short prompt beside a few decode rows (a server's time to first token) pays
# for its padded tokens. SmolLM2-135M f32, 2 cores, scan_layers, one prefill row beside 1 / 8
# decode rows: 63 / 67 ms at 16 tokens, 79 / 83 at 32, 116 / 129 at 64 (medians of 21 runs,
# scratch timing of the compiled steps, 2026-12-05); ShareGPT-like prompts are ~25 tokens at
# the median. The cost: two more token buckets (16, 32), so more programs per decode bucket.


def decode_bucket(n: int) -> int:
  """Padded decode rows for n sequences: 1 for one (a single user's stream decodes alone), else a
  power of two >= MIN_DECODE_ROWS. One row against eight: SmolLM2-135M f32 on 2 cores, jax
  0.12, 27.9 -> 22.2 ms per decode step in a scratch timing (now `python -m
  experiments.decode_round_bench`, not yet re-run): the weight reads are the same, the matmul
  and attention work is not."""
  return 1 if n == 1 else next_pow2(n, MIN_DECODE_ROWS)


def round_bucket(n: int) -> int:
  """Padded rows of a k-step decode round for n sequences: the next power of two (1, 2, 4, 8,
  ...). A round is all decode rows, and on a CPU its matmuls cost by the padded rows, not by
  the weights read: SmolLM2-135M f32, jax 0.10.2, 2 cores, one user's round padded to 1 / 2 /
  4 / 8 rows: 34 / 42 / 54 / 71 ms per step (`python -m experiments.decode_round_bench
  --rows=1,2,4,8`). So two users' round takes 2 rows, not 8 (`decode_bucket`'s floor, kept by
  the mixed step, whose rows multiply its program count)."""
  return next_pow2(n)


def table_width(longest: int, max_pages_per_seq: int, fixed: bool = False) -> int:
  """Padded block-table width for a batch whose longest table has `longest` pages. fixed: the
  model's whole context, whatever the batch (one width, so widths multiply no program count;
  the XLA path's work follows seq_lens, so the wider table costs its int32s alone; the Pallas
  kernel splits keys by the width, so it keeps the buckets)."""
  if fixed:
    return next_pow2(max_pages_per_seq)
  return max(next_pow2(longest), min(MIN_TABLE_WIDTH, next_pow2(max_pages_per_seq)))


def pad_block_tables(tables: Sequence[Sequence[int]], num_rows: int,
                     width: int | None = None) -> np.ndarray:
  """i32[num_rows, width] with NULL_PAGE past each table and in padding rows; width defaults to
  next_pow2 of the longest table."""
  longest = max((len(t) for t in tables), default=1)
  width = next_pow2(longest) if width is None else width
  if longest > width:
    raise ValueError(f"a block table of {longest} pages does not fit width={width}")
  out = np.full((num_rows, width), NULL_PAGE, np.int32)
  for i, t in enumerate(tables):
    out[i, :len(t)] = t
  return out


def sampling_rows(plan: StepPlan) -> list:
  """(params, seed, sample_index, output_index) of every sample row, in the plan's row order."""
  rows = []
  for r in plan.rows:
    g = r.group
    for j in range(r.num_samples):
      sample_index = j if r.num_samples > 1 else r.seq.sample_index
      rows.append((g.params, g.seed, sample_index, r.seq.num_output_tokens))
  return rows


def build_step(plan: StepPlan, bm: BlockManager, max_pages_per_seq: int = 1,
               fixed_width: bool = False, q_from_tokens: bool = False) -> dict:
  """Arrays of a one-step plan (decode rows and prefill chunks mixed); fixed_width: as in
  `table_width`; q_from_tokens: max_q_len from the step's token bucket, not its longest chunk
  (`ProgramLimits.q_from_tokens`).

  Returns a dict: tokens, positions, slots i32[num_tokens]; block_tables i32[num_rows, width];
  seq_lens i32[num_rows]; cu_q_lens i32[num_rows + 1]; logits_indices i32[num_samples_padded]
  (the token each sample row samples from); sampling (SamplingArrays); static max_q_len and
  num_decode.
  """
  ps = bm.page_size
  decode, prefill = plan.decode_rows, plan.prefill_rows
  num_decode = decode_bucket(len(decode)) if decode else 0
  num_prefill_rows = next_pow2(len(prefill), MIN_PREFILL_ROWS) if prefill else 0
  chunk_lens = [r.stop - r.start for r in prefill]
  num_prefill_tokens = token_bucket(sum(chunk_lens), MIN_PREFILL_TOKENS) if prefill else 0
  num_rows = num_decode + num_prefill_rows
  num_tokens = num_decode + num_prefill_tokens
  rows = decode + prefill
  tables = [bm.block_table(r.seq.seq_id) for r in rows]
  width = table_width(max(map(len, tables)), max_pages_per_seq, fixed_width)
  block_tables = np.full((num_rows, width), NULL_PAGE, np.int32)
  for i, t in enumerate(tables):
    block_tables[i if i < len(decode) else num_decode + i - len(decode), :len(t)] = t
  tokens = np.zeros(num_tokens, np.int32)
  positions = np.zeros(num_tokens, np.int32)
  slots = np.zeros(num_tokens, np.int32)   # padding writes go to slot 0 of NULL_PAGE
  seq_lens = np.zeros(num_rows, np.int32)
  seq_lens[len(decode):num_decode] = 1      # padding decode rows read their own NULL_PAGE slot
  cu = np.zeros(num_rows + 1, np.int32)
  cu[1:num_decode + 1] = np.arange(1, num_decode + 1)
  for i, r in enumerate(decode):
    tokens[i] = r.seq.tokens[-1]
    positions[i] = r.start
    slots[i] = tables[i][r.start // ps] * ps + r.start % ps   # one slot: plain ints
    seq_lens[i] = r.stop
  offset = num_decode
  for j, r in enumerate(prefill):
    n = r.stop - r.start
    tokens[offset:offset + n] = r.seq.tokens[r.start:r.stop]
    positions[offset:offset + n] = np.arange(r.start, r.stop)
    slots[offset:offset + n] = slots_for_positions(tables[len(decode) + j],
                                                   np.arange(r.start, r.stop), ps)
    seq_lens[num_decode + j] = r.stop
    offset += n
  cu[num_decode + 1:num_decode + len(prefill) + 1] = num_decode + np.cumsum(chunk_lens)
  cu[num_decode + len(prefill) + 1:] = offset
  # One sample row per row (no new shape) unless n > 1 samples or beams need more.
  num_samples = num_rows if plan.num_samples <= num_rows else next_pow2(plan.num_samples)
  logits_indices = np.zeros(num_samples, np.int32)
  s = 0
  for i, r in enumerate(rows):
    last = i if r.is_decode else cu[num_decode + i - len(decode) + 1] - 1
    logits_indices[s:s + r.num_samples] = last
    s += r.num_samples
  return dict(tokens=tokens, positions=positions, slots=slots, block_tables=block_tables,
              seq_lens=seq_lens, cu_q_lens=cu, logits_indices=logits_indices,
              sampling=SamplingArrays.from_rows(sampling_rows(plan), num_samples),
              max_q_len=(next_pow2(num_prefill_tokens if q_from_tokens else max(chunk_lens),
                                   MIN_Q_BUCKET) if prefill else 1),
              num_decode=num_decode)


def build_decode_round(plan: StepPlan, bm: BlockManager, max_pages_per_seq: int = 1,
                       fixed_width: bool = False) -> dict:
  """Arrays of a k-step decode round: tokens, positions, write_limit i32[num_rows];
  block_tables i32[num_rows, width]; sampling (SamplingArrays). Padding rows have write_limit 0."""
  rows = plan.rows
  num_rows = round_bucket(len(rows))
  tokens = np.zeros(num_rows, np.int32)
  positions = np.zeros(num_rows, np.int32)
  limits = np.zeros(num_rows, np.int32)
  for i, r in enumerate(rows):
    tokens[i], positions[i], limits[i] = r.seq.tokens[-1], r.start, r.write_limit
  tables = [bm.block_table(r.seq.seq_id) for r in rows]
  tables = pad_block_tables(tables, num_rows,
                            table_width(max(map(len, tables)), max_pages_per_seq, fixed_width))
  return dict(tokens=tokens, positions=positions, block_tables=tables, write_limit=limits,
              sampling=SamplingArrays.from_rows(sampling_rows(plan), num_rows))


class ProgramKey(NamedTuple):
  """One program the engine compiles: a device step's padded shapes and static options.

  kind: "step" (`step.sample_step`: num_decode decode rows, then num_prefill_rows rows of
  prefill chunks holding num_prefill_tokens tokens, max_q_len their static bound, 1 without
  prefill), "round" (`step.multi_step_decode`: num_steps decode steps of num_decode rows) or
  "link" (`step.decode_link`: one step of a stoppable round, chained by the engine; num_steps 1).
  width: block-table columns; num_samples: sample rows; num_logprobs: the static top-N.
  """
  kind: str
  num_decode: int
  num_prefill_rows: int
  num_prefill_tokens: int
  max_q_len: int
  width: int
  num_samples: int
  num_logprobs: int = 0
  num_steps: int = 1


def program_key(arrays: dict, num_steps: int, num_logprobs: int,
                stoppable_rounds: bool = False) -> ProgramKey:
  """The key of the program that runs `build_step` (num_steps 1) or `build_decode_round` arrays
  (a k-step scan, or with stoppable_rounds the link chained k times)."""
  rows, width = arrays["block_tables"].shape
  samples = arrays["sampling"].temperature.shape[0]
  if num_steps > 1 and stoppable_rounds:
    return ProgramKey("link", rows, 0, 0, 1, width, samples, num_logprobs, 1)
  if num_steps > 1:
    return ProgramKey("round", rows, 0, 0, 1, width, samples, num_logprobs, num_steps)
  d = arrays["num_decode"]
  return ProgramKey("step", d, rows - d, arrays["tokens"].shape[0] - d, arrays["max_q_len"],
                    width, samples, num_logprobs)


@dataclasses.dataclass(frozen=True)
class ProgramLimits:
  """What bounds an engine's step shapes: its scheduler's limits, the model's context, the page
  size, k and the table-width policy (`table_width`)."""
  max_num_seqs: int
  max_num_batched_tokens: int
  max_position: int
  page_size: int
  steps_per_sync: int = 1
  fixed_width: bool = False
  max_prefill_rows: int | None = None   # the scheduler's bound on prefill chunks per step
  stoppable_rounds: bool = False   # rounds run as chained "link" programs, not k-step scans
  # A step's max_q_len is next_pow2(its token bucket, MIN_Q_BUCKET), not its longest chunk's:
  # where prefill attention ignores max_q_len (the C++ CPU kernel), so that a step of up to
  # MIN_PREFILL_ROWS prompts runs the program one prompt of its token bucket runs.
  q_from_tokens: bool = False


def _classes(bucket, upper: int) -> dict[int, tuple[int, int]]:
  """bucket value -> (smallest, largest) n in [1, upper] that pads to it."""
  out: dict[int, tuple[int, int]] = {}
  for n in range(1, upper + 1):
    b = bucket(n)
    lo, _ = out.get(b, (n, n))
    out[b] = (lo, n)
  return out


def reachable_programs(limits: ProgramLimits, max_prompts: int | None = None) -> list[ProgramKey]:
  """Every program a run under `limits` can compile with n=1, no beams and no logprobs (those
  add sample-row and top-N variants). A superset: combinations of buckets whose smallest members
  fit the limits together. max_num_seqs=1 gives one user's programs exactly: decode rounds of
  one row, a one-row decode step, and a prefill step per token bucket of one prompt's chunk.
  max_prompts: only steps that prefill at most this many prompts' chunks (besides any number of
  decode rows; every decode program is kept). 1 is what a server under a light load meets:
  requests arrive one at a time and join the running ones."""
  S, B = limits.max_num_seqs, limits.max_num_batched_tokens
  caps = [c for c in (max_prompts, limits.max_prefill_rows) if c is not None]
  prompts_cap = min(S, B, *caps)
  longest_chunk = min(B, limits.max_position - 1)
  max_pages = -(-limits.max_position // limits.page_size)
  widths = sorted({table_width(n, max_pages, limits.fixed_width) for n in range(1, max_pages + 1)})
  decode = _classes(decode_bucket, min(S, B))
  rounds = _classes(round_bucket, min(S, B))
  prefill = _classes(lambda n: next_pow2(n, MIN_PREFILL_ROWS), prompts_cap)
  tokens = _classes(lambda n: token_bucket(n, MIN_PREFILL_TOKENS), B)
  keys = []
  for w in widths:
    if limits.steps_per_sync > 1 and limits.stoppable_rounds:
      keys += [ProgramKey("link", d, 0, 0, 1, w, d, 0, 1) for d in rounds]
    elif limits.steps_per_sync > 1:
      keys += [ProgramKey("round", d, 0, 0, 1, w, d, 0, limits.steps_per_sync) for d in rounds]
    for d, (nd, _) in [(0, (0, 0))] + sorted(decode.items()):
      if d:
        keys.append(ProgramKey("step", d, 0, 0, 1, w, d))
      for p, (np_lo, np_hi) in sorted(prefill.items()):
        if nd + np_lo > S:
          continue
        rows_hi = min(np_hi, S - nd)
        for t, (t_lo, t_hi) in sorted(tokens.items()):
          t_lo, t_hi = max(t_lo, np_lo), min(t_hi, B - nd)
          if t_lo > t_hi:
            continue
          # the longest chunk: at least an even share of the tokens, at most all of them
          longest = range(-(-t_lo // rows_hi), min(t_hi, longest_chunk) + 1)
          qs = ({next_pow2(t, MIN_Q_BUCKET)} if longest and limits.q_from_tokens else
                {next_pow2(c, MIN_Q_BUCKET) for c in longest})
          keys += [ProgramKey("step", d, p, t, q, w, d + p) for q in sorted(qs)]
  return keys


def placeholder_arrays(key: ProgramKey) -> dict:
  """Arrays shaped as `build_step` / `build_decode_round` make them for `key`, every row padding
  (what `Engine.warmup` lowers a program with: shapes and dtypes are what it compiles for)."""
  d, w, s = key.num_decode, key.width, key.num_samples
  sampling = SamplingArrays.from_rows([], s)
  if key.kind in ("round", "link"):
    zeros = np.zeros(d, np.int32)
    return dict(tokens=zeros, positions=zeros, write_limit=zeros,
                block_tables=np.full((d, w), NULL_PAGE, np.int32), sampling=sampling)
  rows, tokens = d + key.num_prefill_rows, d + key.num_prefill_tokens
  seq_lens = np.zeros(rows, np.int32)
  seq_lens[:d] = 1
  cu = np.full(rows + 1, d, np.int32)
  cu[:d + 1] = np.arange(d + 1)
  zeros = np.zeros(tokens, np.int32)
  return dict(tokens=zeros, positions=zeros, slots=zeros,
              block_tables=np.full((rows, w), NULL_PAGE, np.int32), seq_lens=seq_lens,
              cu_q_lens=cu, logits_indices=np.zeros(s, np.int32), sampling=sampling,
              max_q_len=key.max_q_len, num_decode=d)


def copy_batches(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
  """Splits copy-on-write pairs, in the order they arose, into conflict-free batches: within a
  batch no page is a destination twice and no destination is also a source (XLA leaves the
  order of conflicting scatters unspecified). A pair that conflicts starts the next batch."""
  batches: list[list[tuple[int, int]]] = []
  current: list[tuple[int, int]] = []
  srcs: set[int] = set()
  dsts: set[int] = set()
  for src, dst in pairs:
    if src in dsts or dst in srcs or dst in dsts:
      batches.append(current)
      current, srcs, dsts = [], set(), set()
    current.append((src, dst))
    srcs.add(src)
    dsts.add(dst)
  if current:
    batches.append(current)
  return batches


def pad_copy_pairs(pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
  """(src, dst) i32[next_pow2(len(pairs))], padded with NULL_PAGE -> NULL_PAGE (harmless)."""
  n = next_pow2(len(pairs))
  src = np.full(n, NULL_PAGE, np.int32)
  dst = np.full(n, NULL_PAGE, np.int32)
  if pairs:
    src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
  return src, dst


class TableValidationError(RuntimeError):
  """A step's arrays would read or write a page the row's sequence does not own."""


def validate_step(plan: StepPlan, arrays: dict, bm: BlockManager) -> None:
  """Checks a step's arrays against the block manager before they reach the device (cheap:
  vectorized NumPy over the rows; the engine's `validate_tables` option).

  Every real row's table is exactly its sequence's block table (then NULL_PAGE); every page it
  references is in use (refcount >= 1: owned by it, or legitimately shared); page ids lie in
  [0, num_pages); every token a row writes goes to the slot its position has in the row's own
  table, in a page no other sequence shares (refcount 1: a write into a shared page would be a
  missed copy-on-write); padding rows reference only NULL_PAGE and padding tokens write only
  into it.

  Args:
    plan: the step's plan; arrays: what `build_step` (plan.num_steps == 1) or
      `build_decode_round` made of it.

  Raises:
    TableValidationError naming the row, sequence and page.
  """
  ps, num_pages = bm.page_size, bm.num_pages
  tables = arrays["block_tables"]
  if tables.dtype != np.int32:
    raise TableValidationError(f"block_tables has dtype {tables.dtype}, not int32")
  bad = (tables < 0) | (tables >= num_pages)
  if bad.any():
    r, j = map(int, np.argwhere(bad)[0])
    raise TableValidationError(f"block_tables[{r}, {j}]={tables[r, j]} is outside "
                               f"[0, num_pages={num_pages})")
  single = plan.num_steps == 1
  rows = plan.decode_rows + plan.prefill_rows if single else plan.rows
  if single:
    d = arrays["num_decode"]
    index = np.array(list(range(len(plan.decode_rows))) +
                     [d + j for j in range(len(plan.prefill_rows))], np.int64)
  else:
    index = np.arange(len(rows))
  expected = np.full_like(tables, NULL_PAGE)
  for i, r in zip(index, rows):
    own = bm.block_table(r.seq.seq_id)
    if len(own) > tables.shape[1]:
      raise TableValidationError(f"row {i}: sequence {r.seq.seq_id} has {len(own)} pages; the "
                                 f"table has {tables.shape[1]} columns")
    expected[i, :len(own)] = own
  wrong = (tables != expected).any(axis=1)
  if wrong.any():
    i = int(np.flatnonzero(wrong)[0])
    who = (f"sequence {rows[int(np.flatnonzero(index == i)[0])].seq.seq_id}'s"
           if i in index else "a padding row's")
    raise TableValidationError(f"row {i}: the block table sent {tables[i].tolist()} is not "
                               f"{who} {expected[i].tolist()}")
  used = np.unique(tables[tables != NULL_PAGE])
  refs = dict(zip(used.tolist(), (bm.refcount(p) for p in used.tolist())))
  idle = [p for p, n in refs.items() if n < 1]
  if idle:
    raise TableValidationError(f"page {idle[0]} is in a block table but not in use (refcount 0)")
  # Writes: (row, position, slot) of every token written.
  if single:
    cu, slots, positions = arrays["cu_q_lens"], arrays["slots"], arrays["positions"]
    q_lens = np.diff(cu)
    owner = np.repeat(np.arange(q_lens.size), q_lens)
    written = np.arange(owner.size)
    pad_slots = slots[owner.size:]
    if (pad_slots // ps != NULL_PAGE).any():
      raise TableValidationError(f"a padding token writes into page "
                                 f"{int(pad_slots[pad_slots // ps != NULL_PAGE][0] // ps)}, "
                                 f"not NULL_PAGE")
    real = np.isin(owner, index)
    if (slots[written[~real]] // ps != NULL_PAGE).any():
      raise TableValidationError("a padding row writes outside NULL_PAGE")
    owner, pos, slot = owner[real], positions[written[real]], slots[written[real]]
  else:
    k = plan.num_steps
    positions, limits = arrays["positions"], arrays["write_limit"]
    if (limits[len(rows):] != 0).any():
      raise TableValidationError("a padding row of the decode round has a write limit")
    pos = positions[:, None] + np.arange(k)[None, :]
    valid = pos < limits[:, None]
    owner, pos = np.nonzero(valid)[0], pos[valid]
    slot = None
  col = pos // ps
  if (col >= tables.shape[1]).any():
    i = int(owner[col >= tables.shape[1]][0])
    raise TableValidationError(f"row {i} writes past its table of {tables.shape[1]} columns")
  page = tables[owner, col]
  target = page * ps + pos % ps
  bad = (page == NULL_PAGE) if slot is None else (page == NULL_PAGE) | (slot != target)
  if bad.any():
    i = int(owner[bad][0])
    raise TableValidationError(f"row {i} writes position {int(pos[bad][0])} outside its block "
                               f"table's pages (slot {None if slot is None else int(slot[bad][0])}"
                               f", its page {int(page[bad][0])})")
  for p in np.unique(page).tolist():
    if refs[p] != 1:
      i = int(owner[page == p][0])
      raise TableValidationError(f"row {i} writes into page {p}, which has refcount {refs[p]} "
                                 f"(a write into a shared page: a missed copy-on-write)")
