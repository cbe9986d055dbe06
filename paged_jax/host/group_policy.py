"""What a request does with its sampled tokens: parallel sampling or beam search, over fork / free.

A policy receives the samples of a request's rows after a step and updates its sequences:

- `ParallelSampling` (n >= 1): the prompt's last step is sampled n times; n - 1 children are
  forked from the prompt's sequence (pages shared; a shared partial page is copied when a child
  first writes it), and each sample then runs on its own until it stops.
- `BeamSearch` (beam_width W): every live beam proposes its 2W most likely next tokens; the W best
  continuations by cumulative logprob survive. A parent chosen k times is forked k - 1 times, a
  parent not chosen is freed, so beams share every page up to where they diverged. A candidate
  ending in EOS (or a stop token) becomes a finished hypothesis, scored cumulative logprob /
  (output length ** length_penalty); the search stops when W hypotheses are finished and no live
  beam scores better than the worst of them (Hugging Face's rule with early_stopping=False), or
  at max_tokens. `testing.dense_beam_search` is the same algorithm on a dense model.

Host side, plain Python; the block manager is told of forks and frees here.
"""

from __future__ import annotations

from typing import Callable, Sequence as Seq

import numpy as np

from paged_jax.host.block_manager import BlockManager
from paged_jax.host.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus


class Sample:
  """One sample row's result over the step's num_steps: tokens, logprobs, top-N per step."""
  __slots__ = ("tokens", "logprobs", "top_ids", "top_logprobs")

  def __init__(self, tokens, logprobs, top_ids, top_logprobs):
    self.tokens, self.logprobs = tokens, logprobs
    self.top_ids, self.top_logprobs = top_ids, top_logprobs


def _top(sample: Sample, step: int, n: int) -> dict[int, float] | None:
  if not n:
    return None
  return {int(t): float(lp) for t, lp in zip(sample.top_ids[step][:n], sample.top_logprobs[step][:n])}


def _finish(group: SequenceGroup, seq: Sequence, reason: FinishReason, bm: BlockManager) -> None:
  if seq.seq_id in bm:
    bm.free(seq.seq_id)
  seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
  group.seqs.remove(seq)
  group.finished.append(seq)


class ParallelSampling:
  """n independent samples sharing the prompt's pages (n = 1 is plain generation)."""

  @staticmethod
  def update(group: SequenceGroup, rows: Seq[tuple[Sequence, list[Sample]]], bm: BlockManager,
             new_seq_id: Callable[[], int]) -> None:
    """rows: (sequence, its samples): one sample per row, or n for a prompt sampled n times."""
    for seq, samples in rows:
      members = [seq]
      for j in range(1, len(samples)):   # the prompt's first tokens: fork the other samples
        child = seq.clone(new_seq_id(), sample_index=j)
        bm.fork(seq.seq_id, child.seq_id)
        group.seqs.append(child)
        members.append(child)
      for member, sample in zip(members, samples):
        for step, token in enumerate(sample.tokens):
          member.append(token, sample.logprobs[step], _top(sample, step, group.params.logprobs))
          reason = group.stops(member)
          if reason is not None:
            _finish(group, member, reason, bm)
            break   # tokens sampled past the stop within a k-step round are dropped


class BeamSearch:
  """Beam search over fork / free; the rows of one request arrive together, one per live beam."""

  @staticmethod
  def score(group: SequenceGroup, cumulative_logprob: float, num_output_tokens: int) -> float:
    return cumulative_logprob / max(num_output_tokens, 1) ** group.params.length_penalty

  @classmethod
  def update(cls, group: SequenceGroup, rows: Seq[tuple[Sequence, list[Sample]]],
             bm: BlockManager, new_seq_id: Callable[[], int]) -> None:
    p = group.params
    width = p.beam_width
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(group.eos_token_ids))
    candidates = []   # (score key, rank of the beam, token, logprob, beam)
    for rank, (seq, (sample,)) in enumerate(rows):
      for t, lp in zip(sample.top_ids[0][:2 * width], sample.top_logprobs[0][:2 * width]):
        candidates.append((-(seq.cumulative_logprob + float(lp)), rank, int(t), float(lp), seq))
    candidates.sort(key=lambda c: c[:3])
    chosen: list[tuple[Sequence, int, float]] = []
    for i, (_, _, token, lp, beam) in enumerate(candidates):
      if len(chosen) == width:
        break
      if token in stop_ids:
        if i < width:   # only a top-W candidate may end a hypothesis (as Hugging Face)
          cls._add_hypothesis(group, beam, token, lp, FinishReason.STOP, new_seq_id)
        continue
      chosen.append((beam, token, lp))
    # Fork before anything appends: children copy the parent as it was.
    picks: dict[int, list[tuple[int, float]]] = {}
    for beam, token, lp in chosen:
      picks.setdefault(beam.seq_id, []).append((token, lp))
    survivors = []
    for seq, _ in rows:
      mine = picks.get(seq.seq_id, [])
      if not mine:
        bm.free(seq.seq_id)
        continue
      members = [seq]
      for _ in mine[1:]:
        child = seq.clone(new_seq_id())
        bm.fork(seq.seq_id, child.seq_id)
        members.append(child)
      for member, (token, lp) in zip(members, mine):
        member.append(token, lp)
        survivors.append(member)
    survivors.sort(key=lambda s: -s.cumulative_logprob)   # stable: ties keep the rows' order
    group.seqs = survivors
    if group.seqs and group.seqs[0].num_output_tokens >= p.max_tokens:
      for seq in list(group.seqs):   # every live beam has the same length
        cls._add_hypothesis(group, seq, None, 0.0, FinishReason.LENGTH, new_seq_id)
        bm.free(seq.seq_id)
      group.seqs = []
    elif cls._done(group):
      for seq in group.seqs:
        bm.free(seq.seq_id)
      group.seqs = []

  @classmethod
  def _add_hypothesis(cls, group, beam: Sequence, token: int | None, lp: float,
                      reason: FinishReason, new_seq_id) -> None:
    hyp = beam.clone(new_seq_id())
    if token is not None:
      hyp.append(token, lp)
    hyp.status, hyp.finish_reason = SequenceStatus.FINISHED, reason
    group.beam_scores[hyp.seq_id] = cls.score(group, hyp.cumulative_logprob, hyp.num_output_tokens)
    group.finished.append(hyp)
    group.finished.sort(key=lambda s: (-group.beam_scores[s.seq_id], s.seq_id))
    del group.finished[group.params.beam_width:]   # keep the W best

  @classmethod
  def _done(cls, group: SequenceGroup) -> bool:
    if len(group.finished) < group.params.beam_width:
      return False
    worst = group.beam_scores[group.finished[-1].seq_id]
    best = group.seqs[0]
    return worst >= cls.score(group, best.cumulative_logprob, best.num_output_tokens)


def policy_for(group: SequenceGroup):
  return BeamSearch if group.params.use_beam_search else ParallelSampling


def samples_from(out: dict[str, np.ndarray], index: int) -> Sample:
  """Sample row `index` of a step's host arrays (tokens [num_steps, S], ...)."""
  return Sample(out["tokens"][:, index].tolist(), out["logprob"][:, index].tolist(),
                out["top_ids"][:, index], out["top_logprobs"][:, index])
