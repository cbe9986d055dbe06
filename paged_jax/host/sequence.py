"""A request and its sequences: the one owner of token ids, status and what a request produced.

A `SequenceGroup` is one request: a prompt, its `SamplingParams`, and one `Sequence` per live
sample or beam (they share the prompt's pages through the block manager's fork). A `Sequence`
holds the only copy of its token ids (prompt, then output); the block manager is told them as they
arrive and keeps counts and page hashes only. `RequestOutput` is what the engine reports: whole
completions plus the delta since the last report, for streaming. Host side, plain Python.
"""

from __future__ import annotations

import dataclasses
import enum

from paged_jax.sampling import SamplingParams


class SequenceStatus(enum.Enum):
  WAITING = "waiting"    # holds no pages: new, or preempted for recompute
  PREFILL = "prefill"    # holds pages; its prompt (or, after a recompute, its tokens) is being computed
  DECODE = "decode"      # holds pages; every token's K/V is computed but the last one's
  SWAPPED = "swapped"    # its pages' contents are in host memory (it resumes in DECODE)
  FINISHED = "finished"


class FinishReason(str, enum.Enum):
  STOP = "stop"        # EOS or a stop token (kept in the output)
  LENGTH = "length"    # max_tokens reached
  ABORT = "abort"      # Engine.abort
  ERROR = "error"      # its steps kept failing (the group's `error` says why); see Engine


@dataclasses.dataclass(eq=False)
class Sequence:
  """One sample (or beam) of a request.

  Attributes:
    seq_id: engine-wide id, never reused; the block manager's key.
    tokens: prompt token ids, then generated ones: the one copy.
    num_prompt_tokens: how many of `tokens` are the prompt.
    sample_index: which of the request's samples this is (selects its random stream).
    logprobs: logprob of each generated token; top_logprobs: the top-N per token when asked.
    cumulative_logprob: sum of `logprobs` (beam search ranks by it).
  """
  seq_id: int
  tokens: list[int]
  num_prompt_tokens: int
  sample_index: int = 0
  status: SequenceStatus = SequenceStatus.WAITING
  finish_reason: FinishReason | None = None
  logprobs: list[float] = dataclasses.field(default_factory=list)
  top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
  cumulative_logprob: float = 0.0

  @property
  def output_tokens(self) -> list[int]:
    return self.tokens[self.num_prompt_tokens:]

  @property
  def num_output_tokens(self) -> int:
    return len(self.tokens) - self.num_prompt_tokens

  @property
  def is_finished(self) -> bool:
    return self.status is SequenceStatus.FINISHED

  def append(self, token: int, logprob: float, top: dict[int, float] | None = None) -> None:
    self.tokens.append(int(token))
    self.logprobs.append(float(logprob))
    self.cumulative_logprob += float(logprob)
    if top is not None:
      self.top_logprobs.append(top)

  def clone(self, seq_id: int, sample_index: int | None = None) -> "Sequence":
    """A copy under a new id (fork): tokens and logprobs are copied, not shared."""
    return dataclasses.replace(
        self, seq_id=seq_id, tokens=list(self.tokens), logprobs=list(self.logprobs),
        top_logprobs=list(self.top_logprobs),
        sample_index=self.sample_index if sample_index is None else sample_index)


@dataclasses.dataclass(eq=False)
class SequenceGroup:
  """One request: a prompt, its sampling parameters, and its live sequences.

  Attributes:
    request_id: the caller's name for it.
    seqs: live sequences (one while the prompt is prefilled; n samples or the live beams after).
    finished: completed sequences (samples that stopped; beam hypotheses with their scores).
    seed: the request's seed (given, or drawn by the engine).
    eos_token_ids: tokens that stop a completion unless params.ignore_eos.
    order: admission rank (first admission); the newest running group is the preemption victim.
    arrival_time / first_scheduled_time / first_token_time / finish_time: wall clock
      (time.perf_counter()); first scheduled: the start of the first step with a row of it.
    cache_salt: prefix-cache namespace: requests with different salts never share pages.
    num_cached_tokens: prompt tokens its first admission found in the prefix cache.
    suspect: a step it was part of failed; it runs alone until a step of its own succeeds.
    failures: steps that failed while it ran alone; error: the last failure's message.
  """
  request_id: str
  prompt: tuple[int, ...]
  params: SamplingParams
  seqs: list[Sequence]
  seed: int
  eos_token_ids: frozenset[int] = frozenset()
  finished: list[Sequence] = dataclasses.field(default_factory=list)
  beam_scores: dict[int, float] = dataclasses.field(default_factory=dict)   # seq_id -> score
  order: int | None = None
  arrival_time: float = 0.0
  first_scheduled_time: float | None = None
  first_token_time: float | None = None
  finish_time: float | None = None
  aborted: bool = False
  cache_salt: str | None = None
  num_cached_tokens: int = 0
  suspect: bool = False
  failures: int = 0
  error: str | None = None
  num_reported: dict[int, int] = dataclasses.field(default_factory=dict)    # seq_id -> tokens
  text_reported: dict[int, str] = dataclasses.field(default_factory=dict)
  context_text: str | None = None   # the prompt's last tokens as text (Engine._continuation)

  @property
  def max_seqs(self) -> int:
    """Sequences (batch rows) the group may hold at once."""
    return self.params.beam_width if self.params.use_beam_search else self.params.n

  @property
  def is_finished(self) -> bool:
    return not self.seqs

  def stops(self, seq: Sequence) -> FinishReason | None:
    """Why `seq` must stop after its last token, if it must."""
    last = seq.tokens[-1]
    if (not self.params.ignore_eos and last in self.eos_token_ids) or \
        last in self.params.stop_token_ids:
      return FinishReason.STOP
    if seq.num_output_tokens >= self.params.max_tokens:
      return FinishReason.LENGTH
    return None

  def completions(self) -> list[Sequence]:
    """The sequences to report, best first for beam search, sample order otherwise."""
    if self.params.use_beam_search:
      ranked = sorted(self.finished + self.seqs,
                      key=lambda s: (-self.beam_scores.get(s.seq_id, s.cumulative_logprob),
                                     s.seq_id))
      return ranked[:self.params.n]
    return sorted(self.finished + self.seqs, key=lambda s: s.sample_index)


@dataclasses.dataclass
class CompletionOutput:
  """One completion of a request.

  Attributes:
    index: its rank (beam search) or sample index.
    token_ids: every generated token so far.
    new_token_ids: the tokens added since this request's previous output (the stream delta).
    text / new_text: decoded `token_ids` / its new part, when the engine has a tokenizer.
    logprobs: logprob of each generated token; top_logprobs: {token: logprob} per token if asked.
    cumulative_logprob: their sum; score: the beam score (cumulative_logprob otherwise).
    finish_reason: None while running; "stop", "length", "abort" or "error".
  """
  index: int
  token_ids: list[int]
  new_token_ids: list[int]
  text: str | None
  new_text: str | None
  logprobs: list[float]
  top_logprobs: list[dict[int, float]] | None
  cumulative_logprob: float
  score: float
  finish_reason: str | None


@dataclasses.dataclass
class RequestOutput:
  """What a step reports for one request.

  Attributes:
    ttft: time to first token (s), from add_request to the first sampled token.
    time_in_queue: arrival to the start of the first step that ran a row of it (s; vLLM's
      name): waiting for admission, and for the step in flight when it arrived. ttft -
      time_in_queue is its prefill (the steps of its prompt's chunks).
    tpot: time per output token after the first (s), over the longest completion; None until
      the request finishes or while it has one token.
    num_cached_tokens: prompt tokens served by the prefix cache (of its own cache_salt only).
    error: why it finished with reason "error", else None.
  """
  request_id: str
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  finished: bool
  arrival_time: float
  ttft: float | None
  tpot: float | None
  finish_time: float | None
  num_cached_tokens: int = 0
  error: str | None = None
  time_in_queue: float | None = None
