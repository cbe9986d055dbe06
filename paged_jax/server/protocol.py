"""The OpenAI API's request schemas (pydantic) and the response bodies, as plain functions.

Requests: `CompletionRequest` (`POST /v1/completions`) and `ChatCompletionRequest`
(`POST /v1/chat/completions`), with vLLM's extensions (`top_k`, `ignore_eos`,
`stop_token_ids`). Fields the API defines that this engine cannot honour (`presence_penalty`,
`best_of`, ...) are refused by name when set to anything but their no-op value; fields the API
does not define are ignored, as OpenAI's server and vLLM's ignore them. Responses are dicts in
the API's shapes (`completion_body`, `chat_body`, the streaming chunks), built from the engine's
`CompletionOutput`s, so their tests need no server.

Stop strings are the server's (the engine stops on token ids): `StopStrings` cuts a completion's
text at the first stop string and holds back, while streaming, any tail that could still become
one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import pydantic

from paged_jax.sampling import SamplingParams

MAX_LOGPROBS = 20   # vLLM's default cap on top logprobs per token (OpenAI's: 5 / 20)


class ProtocolError(ValueError):
  """A request the API accepts in form but this server cannot serve (400), naming the field."""

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


class _Request(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="ignore", strict=False)

  model: str | None = None
  max_tokens: int | None = pydantic.Field(default=None, ge=1)
  temperature: float = pydantic.Field(default=1.0, ge=0.0)
  top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
  top_k: int = pydantic.Field(default=0, ge=-1)   # vLLM's extension; -1 or 0 = off
  n: int = pydantic.Field(default=1, ge=1)
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  # The API's knobs this engine has no implementation of: refused unless left at their no-op.
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  best_of: int | None = None
  suffix: str | None = None

  @pydantic.field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty",
                            mode="before")
  @classmethod
  def _number(cls, v, info):   # pydantic would take "0.5" or True; the API's numbers are numbers
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise ValueError(f"{info.field_name} must be a number, got {v!r}")
    return v

  @pydantic.field_validator("max_tokens", "top_k", "n", "seed", "best_of", mode="before")
  @classmethod
  def _int(cls, v, info):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
      raise ValueError(f"{info.field_name} must be an integer, got {v!r}")
    return v

  def check_supported(self) -> None:
    unsupported = [("presence_penalty", self.presence_penalty, 0.0),
                   ("frequency_penalty", self.frequency_penalty, 0.0),
                   ("logit_bias", self.logit_bias or None, None),
                   ("suffix", self.suffix or None, None)]
    for name, value, noop in unsupported:
      if value != noop:
        raise ProtocolError(f"{name}={value!r} is not supported by this server", name)
    if self.best_of not in (None, self.n):
      raise ProtocolError(f"best_of={self.best_of} is not supported (only best_of = n)",
                          "best_of")
    if self.seed is not None and not 0 <= self.seed < 2 ** 63:
      raise ProtocolError(f"seed={self.seed} must be in [0, 2**63)", "seed")

  @property
  def stops(self) -> tuple[str, ...]:
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
    if any(not s for s in stops):
      raise ProtocolError(f"stop={self.stop!r}: a stop string must not be empty", "stop")
    return tuple(stops)

  @property
  def include_usage(self) -> bool:
    return bool(self.stream and self.stream_options and self.stream_options.include_usage)

  def sampling_params(self, max_tokens: int, logprobs: int, extra_stop_ids=()) -> SamplingParams:
    """The engine's SamplingParams (a ValueError from it names the bad value)."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=float(self.temperature), top_p=float(self.top_p),
        top_k=max(0, self.top_k), n=self.n,
        seed=None if self.seed is None else self.seed % 2 ** 32,
        stop_token_ids=tuple(dict.fromkeys([*(self.stop_token_ids or ()), *extra_stop_ids])),
        ignore_eos=self.ignore_eos, logprobs=logprobs)


class StreamOptions(pydantic.BaseModel):
  include_usage: bool = False


class CompletionRequest(_Request):
  """`POST /v1/completions`: prompt as text, token ids, or a list of either."""
  prompt: str | list[int] | list[str] | list[list[int]]
  logprobs: int | None = pydantic.Field(default=None, ge=0, le=MAX_LOGPROBS)
  echo: bool = False

  def prompts(self) -> list[str | list[int]]:
    p = self.prompt
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
      return [p]
    if not p:
      raise ProtocolError("prompt is empty", "prompt")
    return list(p)


class ChatMessage(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow")
  role: Literal["system", "user", "assistant", "tool", "developer"]
  content: str | list[dict[str, Any]] | None = None

  def text(self) -> str:
    """The content as text: a string, or the text parts of a list of parts."""
    if self.content is None or isinstance(self.content, str):
      return self.content or ""
    parts = []
    for part in self.content:
      if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ProtocolError(f"message content part {part!r}: only text parts are supported",
                            "messages")
      parts.append(part["text"])
    return "".join(parts)


class ChatCompletionRequest(_Request):
  """`POST /v1/chat/completions`."""
  messages: list[ChatMessage] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=MAX_LOGPROBS)

  def rendered_messages(self) -> list[dict]:
    return [{"role": m.role, "content": m.text()} for m in self.messages]

  @property
  def num_logprobs(self) -> int:
    """Top logprobs per token the engine returns (the sampled token's own always comes)."""
    if self.top_logprobs and not self.logprobs:
      raise ProtocolError("top_logprobs needs logprobs=true", "top_logprobs")
    return self.top_logprobs or 0


CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


# ---------------------------------------------------------------------------- stop strings

class StopStrings:
  """Stop strings on one completion's growing text.

  `update(text)` takes the completion's whole text so far and returns (the text that may be
  sent, stopped): cut before the first stop string once one appears, and until then short of
  any tail that is a prefix of a stop string (it may turn into one with the next token)."""

  def __init__(self, stops: tuple[str, ...]):
    self.stops = stops

  def update(self, text: str) -> tuple[str, bool]:
    if not self.stops:
      return text, False
    cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
    if cuts:
      return text[:min(cuts)], True
    hold = 0
    for s in self.stops:
      for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
          hold = max(hold, k)
          break
    return text[:len(text) - hold], False


# ---------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict:
  """The OpenAI API's error object (its clients read error.message)."""
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokens: list[str], logprobs: list[float],
                        top: list[dict[str, float]] | None, text_offset: int) -> dict:
  """The completions API's logprobs object for consecutive tokens starting at `text_offset`."""
  offsets, at = [], text_offset
  for t in tokens:
    offsets.append(at)
    at += len(t)
  return {"tokens": tokens, "token_logprobs": logprobs,
          "top_logprobs": top if top is not None else None, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float],
                  top: list[dict[str, float]] | None) -> dict:
  """The chat API's logprobs object: one entry per token with its top alternatives."""
  def entry(token, lp):
    return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}
  content = []
  for i, (t, lp) in enumerate(zip(tokens, logprobs)):
    e = entry(t, lp)
    e["top_logprobs"] = [entry(tt, tlp) for tt, tlp in (top[i].items() if top else ())]
    content.append(e)
  return {"content": content}


def completion_body(request_id: str, model: str, choices: list[dict], usage_: dict,
                    created: int | None = None) -> dict:
  return {"id": request_id, "object": "text_completion", "created": created or int(time.time()),
          "model": model, "choices": choices, "usage": usage_}


def chat_body(request_id: str, model: str, choices: list[dict], usage_: dict,
              created: int | None = None) -> dict:
  return {"id": request_id, "object": "chat.completion", "created": created or int(time.time()),
          "model": model, "choices": choices, "usage": usage_}


def completion_chunk(request_id: str, model: str, created: int, choices: list[dict],
                     usage_: dict | None = None, include_usage: bool = False) -> dict:
  chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
           "choices": choices}
  if include_usage:
    chunk["usage"] = usage_
  return chunk


def chat_chunk(request_id: str, model: str, created: int, choices: list[dict],
               usage_: dict | None = None, include_usage: bool = False) -> dict:
  chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
           "model": model, "choices": choices}
  if include_usage:
    chunk["usage"] = usage_
  return chunk
