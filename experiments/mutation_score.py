"""Mutation score of the core modules: mutmut (3.x) run per module, outside CI's time budget.

  .venv/bin/pip install -e '.[test,mutation]'
  .venv/bin/python -m experiments.mutation_score --modules=block_manager,scheduler
  .venv/bin/python -m experiments.mutation_score --modules=all        # hours on 2 cores
  .venv/bin/python -m experiments.mutation_score --modules=reference --resume=/tmp/mutation_xyz

For each module it makes a scratch clone of the working tree, writes a `[mutmut]` section that
mutates that one file and runs only the tests that exercise it (MODULES below), runs
`mutmut run`, and reads mutmut's own counts (`mutmut export-cicd-stats`). It prints, and appends
to --out, per module: killed, survived, timed out, no tests, total, and the score
killed / (total - equivalent) (a mutant no test reaches is not killed), with the surviving
mutants' names and diffs (so a survivor can be judged: a missing test, or an equivalent mutant to
list in EQUIVALENT with its reason). Timeouts and crashes (exit -9 / -11: mutmut SIGKILLs a
worker past its CPU limit) count as killed. Mutants only a GPU can tell apart (GPU_ONLY) leave the
score too, which is also given counting them as survivors.
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# module name -> (file to mutate, tests that exercise it).
MODULES = {
    "block_manager": ("paged_jax/host/block_manager.py",
                      ["tests/paged_jax/host/block_manager_test.py"]),
    "scheduler": ("paged_jax/host/scheduler.py", ["tests/paged_jax/host/scheduler_test.py"]),
    "sampling": ("paged_jax/sampling.py", ["tests/paged_jax/sampling_test.py"]),
    "merge": ("pallas_kernels/paged_attention/merge.py", ["tests/paged_jax/attention_test.py"]),
    "reference": ("pallas_kernels/paged_attention/reference.py",
                  ["tests/paged_jax/attention_test.py"]),
    "attention": ("paged_jax/attention.py", ["tests/paged_jax/attention_test.py"]),
    "kernel": ("pallas_kernels/paged_attention/kernel_triton.py",
               ["tests/pallas_kernels/paged_attention_test.py"]),
    "kv_write": ("paged_jax/kv_write.py", ["tests/paged_jax/state_test.py"]),
    # state_test alone (PageOpsTest tests every function directly; the engine tests reach
    # page_ops too, but at minutes a run).
    "page_ops": ("paged_jax/page_ops.py", ["tests/paged_jax/state_test.py"]),
}

# Imported by the fork server before it forks workers: libraries only (importing them runs no JAX
# computation; the project's modules may, at import).
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.linen", "chex", "hypothesis", "absl.testing.absltest",
           "pytest")

# Mutants judged equivalent (no test can tell them from the original), by mutmut name, with why.
# Filled in from runs of this script; see WORKSPACE.md, "Mutation testing".
_BM = "paged_jax.host.block_manager.xǁBlockManagerǁ"
_SCHED = "paged_jax.host.scheduler.xǁSchedulerǁ"
_MERGE = "pallas_kernels.paged_attention.merge.x_"
_SAMPLING = "paged_jax.sampling.x_"
_PAGE_OPS = "paged_jax.page_ops.x_"
_REF = "pallas_kernels.paged_attention.reference.x_"
_ATT = "paged_jax.attention.x_"
_KER = "pallas_kernels.paged_attention.kernel_triton.x_"
EQUIVALENT: dict[str, str] = {
    # block_manager.py
    f"{_BM}stats__mutmut_21":
        "stored.get(None, 0) for stored.get(p, 0): a page shared by several sequences holds the "
        "same number of tokens in each (a write into a shared page copies it first), so the max "
        "over its owners equals the last owner's value",
    f"{_BM}stats__mutmut_53":
        "max(2, queries) for max(1, queries) in prefix_hit_rate: they differ only at queries <= 1, "
        "where hits are 0 (the last prompt token is never a hit), so the rate is 0 either way",
    **{f"{_BM}admit__mutmut_{n}": "a field of the probe _Seq (block_table None, num_computed "
       "None or 1) that admit overwrites before anything reads it" for n in (32, 33, 42)},
    f"{_BM}admit__mutmut_49":
        "_lookup with prefix caching off: _add_tokens computes no hashes then, so the lookup "
        "finds nothing, as the [] it replaces",
    **{f"{_BM}swap_in__mutmut_{n}": "num_swapped_pages 1 / swap_group None on a running "
       "sequence: both are read only while it is SWAPPED, and swap_out sets them first"
       for n in (28, 29)},
    **{f"{_BM}check_invariants__mutmut_{n}": "the dtype left to NumPy: counted becomes float64 "
       "(assert_array_equal compares values), block tables of Python ints become int64 anyway"
       for n in (5, 7, 16, 18)},
    f"{_BM}_take__mutmut_6":
        "popitem(last=None) for popitem(last=False): None is false, so the LRU end is popped",
    f"{_BM}_unref__mutmut_7":
        "the value stored in the idle OrderedDict ('' for None): only its keys and order are read",
    # scheduler.py
    f"{_SCHED}schedule__mutmut_43":
        "break for continue after a request preempted itself: it was the newest, the last in the "
        "running list, so the loop is over either way",
    f"{_SCHED}_grow__mutmut_27":
        "new = None for new = [] once the tokens are appended: only its truth is read after",
    **{f"{_SCHED}_swap_in__mutmut_{n}": "rows and budget never bind at a swap-in (5: '-' for '+' "
       "and 16: 'and' for 'or' in rows_ok / the refusal; 6, 14, 18: '<' / '>=' at equality): "
       "swapped requests block admission, so running seats only fall after a swap-out, and "
       "pages free up only when a request or sample finishes (its seats go too); at a swap-in "
       "with room, seats + the request's seats < max_num_seqs <= max_num_batched_tokens, and "
       "with nothing running its pages are fewer than the pool (the request that preempted it "
       "held one)" for n in (5, 6, 14, 16, 18)},
    f"{_SCHED}_prefill_running__mutmut_7":
        "budget < 0 for budget <= 0: _add_chunk with a budget of 0 adds no row and returns 0",
    **{f"{_SCHED}_add_chunk__mutmut_{n}": "the stop <= start branch (14: '<', 15: returns 1) is "
       "unreachable: the callers pass a budget > 0, a prefilling sequence has uncomputed tokens "
       "before its end, and a recomputed beam is left two tokens (admit(min_uncached=2))"
       for n in (14, 15)},
    f"{_SCHED}_add_chunk__mutmut_24":
        "is_decode None for False: every reader tests its truth",
    **{f"{_SCHED}_admit__mutmut_{n}": "return for break: nothing follows the admission loop"
       for n in (13, 16, 26, 29, 71)},
    f"{_SCHED}_admit__mutmut_79":
        "= for += on num_cached_tokens at a request's first admission: it has one sequence then, "
        "and the count starts at 0",
    f"{_SCHED}_admit__mutmut_90":
        "budget >= 0 for budget > 0 before a chunk: _add_chunk with a budget of 0 adds no row",
    # merge.py
    f"{_MERGE}block_summary__mutmut_2":
        "the default einsum spelled in capitals ('...T,...TD->...D'): the same contraction",
    **{f"{_MERGE}{name}": "the stand-in shift for an empty summary (m = -inf) is 1.0, not 0.0: "
       "exp(-inf - anything) is 0 either way" for name in (
           "block_summary__mutmut_18", "merge_summaries__mutmut_14", "merge_along__mutmut_15")},
    **{f"{_MERGE}block_summary__mutmut_{n}": "einsum precision default for HIGHEST: the same "
       "on the CPU, where every test runs (f32 dots are full f32); on a GPU the default is "
       "TF32 and the kernel's GPU tests are the ones that would see it" for n in (37, 41)},
    **{f"{_MERGE}finalize__mutmut_{n}": "the stand-in z of an empty summary is 2.0, not 1.0: "
       "its u is 0 and its lse is replaced by -inf, so neither shows" for n in (12, 28)},
    # sampling.py
    **{f"{_SAMPLING}{name}": "axis / shape index +1 for -1: truncate and sample take f32[S, V], "
       "two axes, where axis 1 is the last" for name in (
           "truncate__mutmut_2", "truncate__mutmut_9", "truncate__mutmut_42",
           "truncate__mutmut_50", "truncate__mutmut_71", "sample__mutmut_35",
           "sample__mutmut_55", "sample__mutmut_65")},
    **{f"{_SAMPLING}{name}": "axis=-1 dropped: -1 is the default axis of jnp.sort, "
       "jax.nn.softmax and jnp.take_along_axis" for name in (
           "truncate__mutmut_8", "truncate__mutmut_41", "sample__mutmut_64")},
    **{f"{_SAMPLING}{name}": "dtype None or left out: JAX's default integer (int32, 64-bit off, "
       "the project's setting) / float (float32) is the dtype spelled out; top_ids is cast to "
       "int32 on return anyway" for name in (
           "argmax__mutmut_17", "argmax__mutmut_19", "sample__mutmut_76", "sample__mutmut_78",
           "sample__mutmut_83", "sample__mutmut_85")},
    f"{_SAMPLING}sample__mutmut_4":
        "logits.astype(None) for astype(float32): JAX reads dtype None as its default float, "
        "float32 (a bf16 input comes out float32 either way; TruncateAndOutputsTest)",
    **{f"{_SAMPLING}sample__mutmut_{n}": "the temperature stand-in of a greedy row (17: t >= 0 "
       "divides by 0; 19: 2.0 for 1.0): a greedy row's draw is discarded by where(t > 0, drawn, "
       "greedy), and rows are independent (per-row sort, max, argmax)" for n in (17, 19)},
    f"{_SAMPLING}sample__mutmut_67":
        "[:, 1] for [:, 0] on a [S, 1] gather result: JAX clamps a static out-of-range index, "
        "so it reads column 0",
    # page_ops.py
    **{f"{_PAGE_OPS}{name}": "the host index arrays' dtype left to NumPy (int64): jnp.asarray "
       "makes them int32 (64-bit off), so the same program runs on the same indices" for name in (
           "read_pages__mutmut_3", "read_pages__mutmut_5", "read_pages__mutmut_9",
           "read_pages__mutmut_12", "write_pages__mutmut_3", "write_pages__mutmut_5",
           "write_pages__mutmut_22", "write_pages__mutmut_25")},
    f"{_PAGE_OPS}write_pages__mutmut_30":
        "one padding layer more on K/V: _write stores layers 0..num_layers-1 only, and every "
        "call pads the same way, so one program still serves all counts that pad alike",
    # reference.py
    **{f"{_REF}empty_result__mutmut_{n}": "the empty lse's dtype None or left out: JAX's "
       "default float is the float32 spelled out" for n in (10, 12)},
    **{f"{_REF}paged_attention_reference__mutmut_{n}": "an option left out of (or None in) the "
       "paged reference's own check: dense_attention, called next with the same max_q_len, "
       "sliding_window and soft_cap, refuses the same values with the same messages"
       for n in (7, 8, 9, 16, 17, 18)},
    **{f"{_REF}{name}": "arange's dtype None or left out: JAX's default integer, int32 (64-bit "
       "off), the dtype spelled out" for name in (
           "ragged_to_padded__mutmut_10", "ragged_to_padded__mutmut_12",
           "padded_to_ragged__mutmut_5", "padded_to_ragged__mutmut_7")},
    **{f"{_REF}ragged_to_padded__mutmut_{n}": "the clip of the gathered token index changed "
       "(21: no lower bound, tokens are >= 0 as cu_q_lens is; 22, 25: no upper bound; 31: "
       "num_tokens + 1; 33: at least 1): JAX clamps an out-of-range gather index to the last "
       "token anyway, and only slots past a row's q_len (documented garbage, never read back) "
       "index past the last token" for n in (21, 22, 25, 31, 33)},
    **{f"{_REF}padded_to_ragged__mutmut_{n}": "the clip of a token's row changed (10: no lower "
       "bound, searchsorted is >= 0; 11, 14: no upper bound; 25: num_seqs + 1): only padding "
       "tokens past cu_q_lens[-1] fall past the last row, their gather JAX clamps, and "
       "where(valid, ...) replaces their value by 0" for n in (10, 11, 14, 25)},
    **{f"{_REF}padded_to_ragged__mutmut_{n}": "the bound on a token's slot i changed (34: i <= "
       "max_q_len in valid; 37: no lower clip; 38, 41: no upper clip; 43: max_q_len + 1): a token "
       "of a row has 0 <= i < q_len <= max_q_len, so only padding tokens (valid is False, their "
       "value replaced by 0) reach the changed bounds, and JAX clamps their gather"
       for n in (34, 37, 38, 41, 43)},
    f"{_REF}dense_attention__mutmut_18":
        "q.shape[1] == 0 for q.shape[0] == 0 before the early return: with no query tokens the "
        "general path gives the same empty [0, H, D] result in q's dtype (ReferenceChecksTest "
        "runs it); 0 query heads is no real input",
    f"{_REF}dense_attention__mutmut_28":
        "max_q_len always num_tokens: only the padded width changes, the caller's bound was "
        "checked first",
    **{f"{_REF}dense_attention__mutmut_{n}": "astype(None) / arange dtype None: JAX's default "
       "float32 / int32, the dtypes spelled out (a bf16 array's astype(None) is float32 too)"
       for n in (57, 60, 62, 66, 75)},
    **{f"{_REF}dense_attention__mutmut_{n}": "1 for 0 in K / V slots past kv_len: those scores "
       "are masked to -inf by attention_mask and those weights are 0, so the stand-in never shows "
       "(any finite value guards against NaN)" for n in (73, 82)},
    **{f"{_REF}dense_attention__mutmut_{n}": "einsum precision default for HIGHEST: f32 dots on "
       "the CPU are full f32 either way" for n in (88, 92, 156, 160)},
    **{f"{_REF}dense_attention__mutmut_{n}": "the einsum spelled in capitals: the same "
       "contraction" for n in (94, 162)},
    f"{_REF}dense_attention__mutmut_137":
        "the shift stand-in of a query that sees no key is 1.0, not 0.0: its scores are -inf, so "
        "its weights are 0 either way",
    f"{_REF}dense_attention__mutmut_170":
        "z > 1 for z > 0 in the divisor: a query that sees a key has z >= 1 (its best key "
        "weighs exp(0) = 1), so z is kept, and at z = 1 dividing by the stand-in 1.0 is the same",
    f"{_REF}dense_attention__mutmut_171":
        "2.0 for 1.0 as the divisor of a query that sees no key: its numerator is 0",
    **{f"{_REF}paged_attention_reference__mutmut_{n}": "max_q_len None (num_tokens) for the "
       "caller's bound in the call to dense_attention: only the padded width changes; the "
       "caller's bound was checked just before" for n in (27, 36)},
    # attention.py
    **{f"{_ATT}merge_states__mutmut_{n}": "astype(None) for astype(float32) on the lse / output "
       "of a state: JAX's default float is float32" for n in (9, 19)},
    **{f"{_ATT}merge_states__mutmut_{n}": "the stand-ins of an empty state (lse = -inf) changed "
       "(18: z 1.0 for 0.0; 27: output 1 for 0): its merge weight exp(-inf - m) is 0, and two "
       "empty states finalize to zeros and -inf either way (merge.finalize)" for n in (18, 27)},
    **{f"{_ATT}{name}": "q.shape[1] == 0 for q.shape[0] == 0 before the early return: with no "
       "query tokens the general path gives the same empty result (PrefillEdgeTest runs it); "
       "0 query heads is no real input" for name in (
           "causal_ragged_attention__mutmut_19", "prefill_attention__mutmut_1")},
    f"{_ATT}causal_ragged_attention__mutmut_31":
        "num_seqs one too large: it only raises the static bound on tiles (more empty slots, "
        "whose tokens scatter out of bounds and are dropped) and the clip of a slot's row, "
        "which live slots never reach",
    **{f"{_ATT}causal_ragged_attention__mutmut_{n}": "a tiling floor of 2 for 1 (48: tile, "
       "57: max_q_len's floor in it, 63: tiles per chunk): any tile and chunk size give the same "
       "result; the floors only keep them >= 1" for n in (48, 57, 63)},
    **{f"{_ATT}causal_ragged_attention__mutmut_{n}": "arange's dtype None or left out: JAX's "
       "default int32" for n in (91, 93, 138, 140)},
    **{f"{_ATT}causal_ragged_attention__mutmut_{n}": "the clip of a tile slot's row changed (96: "
       "no lower bound, searchsorted is >= 0; 97, 100, 110: no upper bound or num_seqs + 1): "
       "only slots past the last row's tiles (not live) get row num_seqs, JAX clamps their "
       "lens / first gathers, and their tokens are num_tokens (none), so nothing of theirs is "
       "read or written" for n in (96, 97, 100, 110)},
    **{f"{_ATT}causal_ragged_attention__mutmut_{n}": "a dead slot's place in the order (115: "
       "the slot just past the last row counted live, a tile past that row's end with no valid "
       "position; 125, 126: its lookback +1 or -2 for -1; 131, 133: an unstable sort): each "
       "slot's queries are masked by their own validity and lookback, and sorting by lookback, "
       "longest first, still puts each chunk's longest first, so only which slots share a "
       "chunk (the time) changes" for n in (115, 125, 126, 131, 133)},
    **{f"{_ATT}causal_ragged_attention__mutmut_{n}": "a dtype None or left out where JAX's "
       "default is the float32 (or int32) spelled out: the padding row of the gather (155, 157: "
       "f32 zeros promote a bf16 K / V to f32, which the next line casts to anyway), the f32 "
       "casts of K, V, q (174, 177, 182: astype(None) is float32 for bf16 too), key positions "
       "(250, 252), the loop's initial summary (309-321)"
       for n in (155, 157, 174, 177, 182, 250, 252, 309, 312, 315, 317, 319, 321)},
    f"{_ATT}causal_ragged_attention__mutmut_159":
        "two zero rows appended for one: index num_tokens still reads a zero row",
    **{f"{_ATT}causal_ragged_attention__mutmut_{n}": "the clip of the key tile kt = tiles_c - o "
       "changed (235: no lower bound; 236, 239, 242: no upper bound or num_slots + 1; 243: "
       "num_slots - 2): kt <= tiles_c < num_slots, a tile with o past its lookback (where kt may "
       "go below its row, or below 0, which JAX wraps) is masked by o <= back_c, and the last "
       "slot is never a live tile: live tiles number sum(ceil(len / tile)) < "
       "ceil(num_tokens / tile) + num_seqs = bound <= num_slots"
       for n in (235, 236, 239, 242, 243)},
    **{f"{_ATT}causal_ragged_attention__mutmut_{n}": "einsum precision default for HIGHEST "
       "(f32 dots on the CPU are full f32) or the einsum spelled in capitals"
       for n in (267, 271, 273, 298)},
    **{f"{_ATT}causal_ragged_attention__mutmut_{n}": "dtype None or left out (343, 345: the "
       "scan's chunk ids, int32; 405, 407, 417, 420: the f32 output / lse buffers) or the "
       "scatter's mode left to its default (401, 403, 412, 414: an out-of-bounds update is "
       "dropped by default, as mode='drop' says): JAX's defaults are the values spelled out"
       for n in (343, 345, 401, 403, 405, 407, 412, 414, 417, 420)},
    f"{_ATT}causal_ragged_attention__mutmut_335":
        "one key-tile offset more per chunk: offset back + 1 is masked for every tile of the "
        "chunk (o <= back_c), so only the time changes",
    **{f"{_ATT}paged_attention__mutmut_{n}": "a check left out of the dispatcher's own "
       "check_static_args (12: the block table; 16, 17, 25, 26: the window / cap): each path it "
       "dispatches to (paged_attention_xla, decode_attention_xla, the kernel) runs the same "
       "check, with the same message, first" for n in (12, 16, 17, 25, 26)},
    **{f"{_ATT}paged_attention__mutmut_{n}": "pages_per_block left to its default on the "
       "decode path: the same result, tiled differently" for n in (114, 121)},
    **{f"{_ATT}paged_attention__mutmut_{n}": "pages_per_block left to its default on "
       "paged_attention_xla: the same result, tiled differently" for n in (129, 136)},
    f"{_ATT}_blocked_attention__mutmut_4":
        "max_q_len always num_tokens: only the padded width changes",
    **{f"{_ATT}_blocked_attention__mutmut_{n}": "the loop's block count one too high (23: + 1 "
       "for - 1; 29: initial=1, a block when no row has a key): the extra block's keys are past "
       "every kv_len and masked, so only the time changes" for n in (23, 29)},
    **{f"{_ATT}_blocked_attention__mutmut_{n}": "the max over kv_lens without initial=0: it "
       "differs only for a batch of zero rows, which fails either way (ragged_to_padded's "
       "gather on no rows; here the max's empty reduction first)" for n in (26, 28)},
    **{f"{_ATT}_blocked_attention__mutmut_{n}": "a dtype None or left out where JAX's default "
       "is the one spelled out: key positions (63, 65: int32), the f32 casts of V and K (69, "
       "88: astype(None) is float32 for bf16 too), the loop's initial summary (135-147: float32)"
       for n in (63, 65, 69, 88, 135, 138, 141, 143, 145, 147)},
    f"{_ATT}_blocked_attention__mutmut_76":
        "1 for 0 in V slots past kv_len: their weights are 0 (scores masked to -inf), and any "
        "finite stand-in guards against NaN",
    **{f"{_ATT}_blocked_attention__mutmut_{n}": "einsum precision default for HIGHEST (f32 dots "
       "on the CPU are full f32) or the einsum spelled in capitals" for n in (81, 85, 87, 124)},
    f"{_ATT}_blocked_attention__mutmut_56":
        "astype(None) for astype(float32) on the queries: JAX's default float is float32",
    f"{_ATT}paged_attention__mutmut_27":
        "q.shape[1] == 0 for q.shape[0] == 0 before the early return: each path returns the same "
        "empty result for zero query tokens itself (BadInputTest.test_zero_query_tokens)",
    **{f"{_ATT}prefill_attention__mutmut_{n}": "a tuning or padding argument of the inner calls "
       "left to its default (27: tile_tokens; 42, 52: max_q_len, the padded width; 43, 53: "
       "pages_per_block): the same result, tiled differently" for n in (27, 42, 43, 52, 53)},
    **{f"{_ATT}prefill_attention__mutmut_{n}": "the max over prefix lengths without initial=0: "
       "a batch has rows (with none, causal_ragged_attention, called first, fails on the "
       "empty cumsum)" for n in (75, 77)},
    **{f"{_ATT}prefill_attention__mutmut_{n}": "the prefix branch taken when no row has a prefix "
       "(78: initial 1; 79: >= 0): it merges an empty state, so only the time changes (the cond "
       "is there to skip it)" for n in (78, 79)},
    **{f"{_ATT}step_attention__mutmut_{n}": "arange's dtype None or left out: JAX's default "
       "int32" for n in (77, 79)},
    f"{_ATT}step_attention__mutmut_83":
        "q.shape[0] >= d: an all-decode batch also runs prefill_attention on zero tokens, which "
        "returns an empty result, and concatenating it changes nothing",
    f"{_ATT}step_attention__mutmut_105":
        "concatenate a single part: the same array",
    f"{_ATT}validate_attention_inputs__mutmut_83":
        "lens / page_size for lens // page_size in the live-page bound -(-lens // page_size): "
        "page j is live when j < ceil(lens / page_size), and for an integer j that is j < "
        "lens / page_size",
    # kernel_triton.py
    **{f"{_KER}_dot__mutmut_{n}": "precision None for HIGHEST in interpret mode's emulated TF32 "
       "dots (42, 45: hi x hi; 54, 57, 62, 65: the tf32x3 cross terms): their operands are "
       "rounded to TF32 already and XLA's CPU dot is exact f32 at any precision, and interpret "
       "mode runs on the CPU" for n in (42, 45, 54, 57, 62, 65)},
    **{f"{_KER}_kernel__mutmut_{n}": "arange's dtype None or left out: JAX's default int32"
       for n in (18, 20, 114, 116)},
    **{f"{_KER}_kernel__mutmut_{n}": "the f32 dtype of the loop's initial m, l or u left to "
       "JAX's default (None or left out): float32" for n in (255, 258, 261, 263, 266, 268)},
    f"{_KER}_kernel__mutmut_197":
        "m_safe's stand-in 1.0 for 0.0 where no key is visible yet: any finite value gives "
        "exp(-inf - value) = 0 for alpha and p",
    f"{_KER}_kernel__mutmut_233":
        "masked V set to 1 instead of 0: its p is exactly 0, and 0 x 1 = 0 (the mask is there "
        "for NaN, which any finite value removes)",
    **{f"{_KER}_kernel__mutmut_{n}": "more inner steps than needed (82: hi_page one page more "
       "past the causal bound; 90: at least one step; 92: + 1; 94: hi_page + lo_page): every "
       "key they add lies past hi_page, past kv_len or after the block's last query, so it is "
       "masked (p = 0, V zeroed) and only the work grows" for n in (82, 90, 92, 94)},
    f"{_KER}_kernel__mutmut_24":
        "rows / group for rows // group: qi gains a fraction in [0, 1), and every use compares "
        "it with integers (qi < q_len, tok <= q_pos, q_pos - tok < window), which a fraction "
        "below 1 cannot flip (f32 holds those positions exactly below 2^21)",
    **{f"{_KER}_kernel__mutmut_{n}": "row_valid widened (26: | for &; 27: rows <= block_q x "
       "group; 29: qi <= q_len): the rows it adds are padding rows (past block_q x group, or past "
       "q_len), whose outputs the wrapper's unrows drops" for n in (26, 27, 29)},
    **{f"{_KER}_kernel__mutmut_{n}": "the program's key range widened (36: last_q + 1; 50: "
       "+ q_len; 51: + 2 in hi_tok; 61: the window's first key 2 earlier; 63: - first_q): the "
       "keys it adds are masked by causality, the window or kv_len, so only the work grows "
       "(no output can tell; a GPU timing would)" for n in (36, 50, 51, 61, 63)},
    f"{_KER}default_tiles__mutmut_1":
        "group's default 2 for 1: plan always passes the group, and the default only matters "
        "to tf32x3 at head_dim 256, where 1 and 2 are both below 8",
    f"{_KER}default_tiles__mutmut_8":
        "head_dim & (head_dim - 2) for & (head_dim - 1): the same for an even head_dim, and the "
        "kernel takes multiples of 16 only",
    f"{_KER}default_tiles__mutmut_30":
        "bf16's second head_dim bound 128 made < 128: 128 never arrives there (a power of two "
        "takes the branch above), and no multiple of 16 lies between",
    **{f"{_KER}default_tiles__mutmut_{n}": "max_chunk None or left out for bf16 head_dim 80 / "
       "96 (/ 112): their power-of-two parts are at most 64 already, so the chunks are the same"
       for n in (36, 41)},
    **{f"{_KER}default_tiles__mutmut_{n}": "a head_dim bound moved up by one (89: 64 -> 65, "
       "154: 96 -> 97, 14, 31, 122 and 171: 128 -> 129): no multiple of 16 between"
       for n in (14, 31, 89, 122, 154, 171)},
    **{f"{_KER}default_tiles__mutmut_{n}": "num_warps None in a branch of 4 warps (17: bf16; "
       "92: f32 \"default\" up to head_dim 64; 189: tf32x3 head_dim 256): plan passes None on "
       "and Pallas' Triton default is 4 (the same kernel: the committed matrix's key matches)"
       for n in (17, 92, 189)},
    **{f"{_KER}default_tiles__mutmut_{n}": "max_chunk None or left out for f32 \"default\" up "
       "to head_dim 64: its one power-of-two part is at most 64 already" for n in (94, 99)},
    f"{_KER}plan__mutmut_16":
        "decode's block_q 1 left to the general rule: max(1, min(_next_pow2(1), ...)) is 1",
    f"{_KER}head_dim_chunks__mutmut_9":
        "max_chunk & (max_chunk - 2) for & (max_chunk - 1): the same for an even value, an odd "
        "one is refused either way, and values below 16 are refused first",
    f"{_KER}_next_pow2__mutmut_7":
        "max(1, ...) for max(0, ...): only _next_pow2(1) changes (2 for 1), and every caller "
        "either takes max(16, ...) of it or calls it with max_q_len > 1",
}


# Mutants only a GPU can tell from the original (the kernel's compiled path, which the CPU runs
# in interpret mode or only lowers), with why: not equivalent, but beyond any CPU test. `score`
# leaves them out like the equivalent ones and also reports the score counting them as
# survivors; experiments/gpu_check.sh runs the kernel tests compiled on a GPU, which would see them.
GPU_ONLY: dict[str, str] = {
    f"{_KER}_kernel__mutmut_9":
        "q_len read from meta_ref[2] of the (2,) meta block: interpret mode clamps the index "
        "to 1 (the same q_len); compiled, it reads past the block (the next sequence's kv_len)",
}


@dataclasses.dataclass(frozen=True)
class MutationConfig:
  modules: tuple[str, ...] = ("block_manager",)
  max_children: int = 2
  keep: bool = False          # keep the scratch clone (to `mutmut show` / `mutmut browse` there)
  resume: str = ""            # a kept clone of an interrupted run of one module: carry on there
  out: str = "experiments/results/mutation_score.jsonl"
  # JAX's persistent compilation cache, shared by the coverage pass and every worker ("" = off).
  compile_cache: str = os.path.join(tempfile.gettempdir(), "paged_jax_mutation_jax_cache")

  def __post_init__(self):
    if self.resume and len(self.modules) != 1:
      raise ValueError(f"resume={self.resume!r} carries on one module's run; got modules="
                       f"{self.modules}")


def _setup_cfg(path: str, source: str, tests: list[str]) -> None:
  cfg = configparser.ConfigParser()
  cfg.read(path)
  if cfg.has_section("mutmut"):
    cfg.remove_section("mutmut")
  cfg.add_section("mutmut")
  cfg.set("mutmut", "source_paths", "\n" + source)
  cfg.set("mutmut", "also_copy", "\npaged_jax\npallas_kernels\nexperiments\ntests\nsetup.cfg")
  cfg.set("mutmut", "pytest_add_cli_args_test_selection", "\n" + "\n".join(tests))
  # JAX's CPU runtime starts thread pools when first used; a worker forked from a process that
  # ran JAX can deadlock, and mutmut reads that as a timeout (counted as killed). So workers fork
  # from a server that has only imported the libraries (PRELOAD), never run a test.
  cfg.set("mutmut", "process_isolation", "forkserver")
  cfg.set("mutmut", "forkserver_warmup", "import")
  preload = os.path.join(os.path.dirname(path), "mutmut_preload.txt")
  with open(preload, "w") as f:
    f.write("\n".join(PRELOAD) + "\n")
  cfg.set("mutmut", "preload_modules_file", preload)
  with open(path, "w") as f:
    cfg.write(f)


def _clone(repo: str) -> str:
  """A scratch copy of the working tree (uncommitted changes included), without venvs."""
  scratch = tempfile.mkdtemp(prefix="mutation_")
  files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=repo, check=True,
                         capture_output=True, text=True).stdout.split("\n")
  for rel in filter(None, files):
    if os.path.isfile(os.path.join(repo, rel)):
      os.makedirs(os.path.join(scratch, os.path.dirname(rel)), exist_ok=True)
      shutil.copy2(os.path.join(repo, rel), os.path.join(scratch, rel))
  return scratch


def _mutmut(args: list[str], cwd: str, env: dict | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "mutmut"] + args, cwd=cwd, capture_output=True,
                        text=True, env=env)


def compile_cache_env(cache_dir: str, base: dict | None = None) -> dict:
  """The environment for `mutmut run`: JAX's persistent compilation cache in cache_dir, every
  program cached however fast it compiled.

  Most mutants leave most of the tests' programs as they were: a mutant of a host-side check, or
  of a function only some tests trace. The cache key is the program (HLO, without source
  locations) and the compile options, so an unchanged program is loaded instead of compiled, and a
  mutant that changes a program misses and compiles its own: a speed-up only, never a different
  result. attention_test: 148 s cold, 41 s warm on 2 cores here.
  """
  env = dict(os.environ if base is None else base)
  if cache_dir:
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  return env


def score(stats: dict, survivors: list[str]) -> dict:
  """Counts and score from mutmut's cicd stats. Survivors listed in EQUIVALENT leave the total,
  and so do those in GPU_ONLY for `score` (what the CPU can test); `score_gpu_only_as_survivors`
  counts the GPU_ONLY ones as survivors. A mutant no test reaches counts as not killed."""
  equivalent = [s for s in survivors if s in EQUIVALENT]
  gpu_only = [s for s in survivors if s in GPU_ONLY and s not in EQUIVALENT]
  # A "segfault" is exit -9 or -11: mutmut SIGKILLs a worker one second after its CPU limit
  # (the kernel's three were loops that never end), so like a timeout the mutant did not pass.
  killed = stats["killed"] + stats.get("timeout", 0) + stats.get("segfault", 0)
  judged = stats["total"] - stats.get("skipped", 0) - len(equivalent)
  cpu_judged = judged - len(gpu_only)
  return dict(killed=killed, survived=stats["survived"] - len(equivalent) - len(gpu_only),
              equivalent=len(equivalent), gpu_only=len(gpu_only),
              timeout=stats.get("timeout", 0) + stats.get("segfault", 0),
              no_tests=stats.get("no_tests", 0),
              total=stats["total"],
              score=killed / cpu_judged if cpu_judged else None,
              score_gpu_only_as_survivors=killed / judged if judged else None)


def _with_status(results: str, status: str) -> list[str]:
  """Mutant names on lines `name: status` of `mutmut results`."""
  return [line.split(":")[0].strip() for line in results.splitlines()
          if line.strip().endswith(": " + status)]


def run_module(name: str, cfg: MutationConfig, repo: str) -> dict:
  if name not in MODULES:
    raise ValueError(f"module {name!r} is not one of {sorted(MODULES)}")
  source, tests = MODULES[name]
  scratch = cfg.resume or _clone(repo)
  try:
    if not cfg.resume:
      _setup_cfg(os.path.join(scratch, "setup.cfg"), source, tests)
    t = time.perf_counter()
    run = _mutmut(["run", "--max-children", str(cfg.max_children)], scratch,
                  env=compile_cache_env(cfg.compile_cache))
    seconds = time.perf_counter() - t
    if run.returncode:
      raise RuntimeError(f"mutmut run failed for {name}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    _mutmut(["export-cicd-stats"], scratch)
    with open(os.path.join(scratch, "mutants", "mutmut-cicd-stats.json")) as f:
      stats = json.load(f)
    results = _mutmut(["results"], scratch).stdout
    survivors = _with_status(results, "survived")
    untested = _with_status(results, "no tests")
    diffs = {s: _mutmut(["show", s], scratch).stdout for s in survivors + untested}
    return dict(module=name, file=source, tests=tests, seconds=seconds, stats=stats,
                **score(stats, survivors), survivors=survivors, untested=untested, diffs=diffs)
  finally:
    if cfg.keep or cfg.resume:
      print(f"kept {scratch}")
    else:
      shutil.rmtree(scratch, ignore_errors=True)


def format_result(r: dict) -> str:
  s = "-" if r["score"] is None else f"{r['score']:.1%}"
  lines = [f"{r['module']:14s} {r['file']}: killed {r['killed']} (timeouts {r['timeout']}), "
           f"survived {r['survived']}, equivalent {r['equivalent']}, "
           f"GPU-only {r.get('gpu_only', 0)}, no tests {r['no_tests']}, "
           f"total {r['total']}; score {s} ({r['seconds'] / 60:.1f} min)"]
  if r.get("gpu_only"):
    lines[0] += f"; {r['score_gpu_only_as_survivors']:.1%} with the GPU-only ones as survivors"
  kind = lambda name: ("equivalent" if name in EQUIVALENT else
                       "GPU-only" if name in GPU_ONLY else "survivor")
  lines += [f"  {kind(name)} {name}" for name in r["survivors"]]
  lines += [f"  no tests {name}" for name in r.get("untested", [])]
  return "\n".join(lines)


def main(argv):
  del argv
  from absl import flags
  f = flags.FLAGS
  modules = tuple(MODULES) if f.modules == ["all"] else tuple(f.modules)
  cfg = MutationConfig(modules=modules, max_children=f.max_children, keep=f.keep, out=f.out,
                       resume=f.resume, compile_cache=f.compile_cache)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for name in cfg.modules:
    r = run_module(name, cfg, repo)
    print(format_result(r), flush=True)
    if cfg.out:
      os.makedirs(os.path.dirname(cfg.out) or ".", exist_ok=True)
      with open(cfg.out, "a") as out:
        out.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_list("modules", ["block_manager"], f"Modules to mutate, from {sorted(MODULES)}, or all.")
  flags.DEFINE_integer("max_children", 2, "Parallel mutmut workers.")
  flags.DEFINE_bool("keep", False, "Keep the scratch clone.")
  flags.DEFINE_string("resume", "", "A clone kept (--keep) from an interrupted run of the one "
                      "module named: mutmut carries on with the mutants not yet run (the row's "
                      "seconds are this part's only).")
  flags.DEFINE_string("compile_cache", MutationConfig.compile_cache,
                      "JAX's persistent compilation cache directory for the tests ('' = off).")
  flags.DEFINE_string("out", "experiments/results/mutation_score.jsonl", "JSONL to append to.")
  app.run(main)
