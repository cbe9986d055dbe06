"""The FastAPI application: the OpenAI API's endpoints over an `EngineRunner`.

  app = create_app(Served(runner, model_name="smollm2", tokenizer=tok, chat=chat, ...))

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). Each completion request becomes one engine request per prompt
(each with its `n` samples on shared pages); its handler awaits the engine's outputs on an
asyncio queue that the engine thread feeds, and either collects them into one response or
streams them as server-sent events (`data: {chunk}` ... `data: [DONE]`), as OpenAI's server
does. A client that disconnects has its engine requests aborted (their pages are free before
the next step). Bad requests get the API's error body (`{"error": {"message", "type", "param",
"code"}}`) with 400 (a bad value: the message names it), 404 (an unknown model) or 503 (the
waiting queue is full, with --max_waiting); the engine goes on serving everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from typing import AsyncIterator

import fastapi
from fastapi import responses
import pydantic

from paged_jax import chat as chat_lib
from paged_jax.server import protocol
from paged_jax.server.protocol import ProtocolError
from paged_jax.server.runner import EngineRunner

_DONE = object()   # queue sentinel: the client went away


@dataclasses.dataclass
class Served:
  """What the app serves.

  Attributes:
    runner: the engine thread.
    model_name: the id clients name in `model` (and /v1/models lists).
    tokenizer: a `tokenizers.Tokenizer` (text prompts, text out, logprob tokens), or None.
    chat: the checkpoint's chat template (`paged_jax.chat.Chat`), or None: /v1/chat refuses.
    max_position: the model's context (the default chat max_tokens fills it).
    max_waiting: refuse (503) a request while this many wait for admission; None = queue all.
  """
  runner: EngineRunner
  model_name: str
  tokenizer: object = None
  chat: chat_lib.Chat | None = None
  max_position: int = 2048
  max_waiting: int | None = None
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class HTTPError(Exception):
  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param = status, message, kind, param


def _error_response(e: HTTPError) -> responses.JSONResponse:
  return responses.JSONResponse(protocol.error_body(e.message, e.kind, e.param, e.status),
                                status_code=e.status)


async def _parse(request: fastapi.Request, model_cls):
  """The body as `model_cls`, or an HTTPError naming what is wrong with it."""
  raw = await request.body()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise HTTPError(400, f"the request body is not UTF-8 ({e.reason} at byte {e.start})") from None
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    raise HTTPError(400, f"the request body is not JSON: {e}") from None
  if not isinstance(obj, dict):
    raise HTTPError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
  try:
    return model_cls.model_validate(obj)
  except pydantic.ValidationError as e:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or None
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    got = f"; got {err['input']!r}" if "input" in err and err["type"] != "missing" else ""
    raise HTTPError(400, f"{where}: {err['msg']}{got}{more}", param=where) from None


@dataclasses.dataclass
class _Choice:
  """One completion's state while a handler serves it."""
  index: int
  stops: protocol.StopStrings
  prefix: str = ""              # echo: the prompt's text, sent before the completion
  sent_text: str = ""           # completion text sent so far (without the prefix)
  sent_tokens: int = 0          # tokens whose logprobs were sent
  token_ids: tuple = ()
  finish_reason: str | None = None
  error: str | None = None
  head_sent: bool = False       # streams: the echoed prompt / the role went out first


class _Job:
  """The engine requests of one HTTP request: one per prompt, `n` choices each."""

  def __init__(self, served: Served, prompts: list[list[int]], params, stops, prefixes):
    self.served = served
    self.prompts, self.params = prompts, params
    n = params.n
    self.choices = [[_Choice(i * n + j, protocol.StopStrings(stops), prefixes[i])
                     for j in range(n)] for i in range(len(prompts))]
    self.queue: asyncio.Queue = asyncio.Queue()
    self.request_ids: list[str | None] = [None] * len(prompts)
    self.engine_done = [False] * len(prompts)

  async def start(self) -> None:
    """Submits every prompt; on a refusal, aborts those already in and raises HTTPError."""
    loop = asyncio.get_running_loop()
    futures = []
    for i, prompt in enumerate(self.prompts):
      def on_output(out, i=i):
        loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))
      futures.append(self.served.runner.submit(prompt, self.params, on_output))
    errors = []
    for i, fut in enumerate(futures):
      try:
        self.request_ids[i] = await asyncio.wrap_future(fut)
      except ValueError as e:
        errors.append((i, e))
      except RuntimeError as e:
        errors.append((i, e))
    if errors:
      self.abort()
      i, e = errors[0]
      status = 400 if isinstance(e, ValueError) else 503
      where = f"prompt {i}: " if len(self.prompts) > 1 else ""
      raise HTTPError(status, f"{where}{e}",
                      kind="invalid_request_error" if status == 400 else "server_error")

  def abort(self) -> None:
    for i, rid in enumerate(self.request_ids):
      if rid is not None and not self.engine_done[i]:
        self.served.runner.abort(rid)
        self.engine_done[i] = True

  @property
  def done(self) -> bool:
    return all(c.finish_reason is not None for cs in self.choices for c in cs)

  async def updates(self) -> AsyncIterator[list[tuple[_Choice, str, object]]]:
    """Yields, per engine output, [(choice, new text, CompletionOutput)] for the choices that
    moved (new text, new tokens, or a finish), until every choice has finished."""
    while not self.done:
      item = await self.queue.get()
      if item is _DONE:
        return
      i, out = item
      if isinstance(out, BaseException):
        for c in self.choices[i]:
          if c.finish_reason is None:
            c.finish_reason, c.error = "error", f"the engine loop failed: {out}"
        yield [(c, "", None) for c in self.choices[i]]
        continue
      if out.finished:
        self.engine_done[i] = True
      moved = []
      for co in out.outputs:
        c = self.choices[i][co.index]
        if c.finish_reason is not None:
          continue
        text = co.text if co.text is not None else ""
        visible, stopped = c.stops.update(text)
        if stopped:
          c.finish_reason = "stop"
        elif co.finish_reason is not None:
          visible = text
          c.finish_reason = co.finish_reason
          if co.finish_reason == "error":
            c.error = out.error or "the request failed"
        new = visible[len(c.sent_text):] if visible.startswith(c.sent_text) else ""
        c.sent_text = visible if visible.startswith(c.sent_text) else c.sent_text
        c.token_ids = tuple(co.token_ids)
        moved.append((c, new, co))
      if all(c.finish_reason is not None for c in self.choices[i]) and not self.engine_done[i]:
        self.served.runner.abort(self.request_ids[i])   # every choice hit a stop string
        self.engine_done[i] = True
      if moved:
        yield moved


def _token_strings(served: Served, ids) -> list[str]:
  tok = served.tokenizer
  if tok is None:
    return [f"token_id:{t}" for t in ids]
  return [tok.decode([int(t)], skip_special_tokens=False) for t in ids]


def _tops(served: Served, tops) -> list[dict[str, float]] | None:
  if tops is None:
    return None
  return [{s: lp for s, lp in zip(_token_strings(served, list(d)), d.values())} for d in tops]


def _check_model(served: Served, name: str | None) -> None:
  if name is not None and name != served.model_name:
    raise HTTPError(404, f"the model `{name}` does not exist; this server serves "
                         f"`{served.model_name}`", kind="not_found_error", param="model")


def _check_capacity(served: Served) -> None:
  if not served.runner.alive:
    raise HTTPError(503, f"the engine is not running ({served.runner.error})", "server_error")
  if served.max_waiting is not None and served.runner.gauges["waiting"] >= served.max_waiting:
    raise HTTPError(503, f"{served.runner.gauges['waiting']} requests are waiting for "
                         f"admission (--max_waiting={served.max_waiting}); retry later",
                    "server_overloaded")


def _sampling(req, max_tokens, logprobs, extra_stop_ids=()):
  try:
    return req.sampling_params(max_tokens, logprobs, extra_stop_ids)
  except ValueError as e:
    raise HTTPError(400, str(e)) from None


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream(job: _Job, make_chunks, final_chunks) -> responses.StreamingResponse:
  """`job` as server-sent events: make_chunks(moved) per update, final_chunks() (usage) at the
  end, then [DONE]. A client that disconnects cancels the stream (Starlette listens for it),
  and the job is aborted: its pages are free before the next step."""
  async def events():
    try:
      async for moved in job.updates():
        for chunk in make_chunks(moved):
          yield _sse(chunk)
        errors = [c.error for c, _, _ in moved if c.error]
        if errors:
          yield _sse(protocol.error_body(errors[0], "server_error", code=500))
      for chunk in final_chunks():
        yield _sse(chunk)
      yield "data: [DONE]\n\n"
    finally:
      job.abort()
  return responses.StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})


async def _disconnected(request: fastapi.Request) -> None:
  while (await request.receive())["type"] != "http.disconnect":
    pass


def create_app(served: Served) -> fastapi.FastAPI:
  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    served.runner.shutdown(timeout=30)   # aborts what still runs

  app = fastapi.FastAPI(title="paged_jax", lifespan=lifespan)

  @app.exception_handler(HTTPError)
  async def _http_error(request, e: HTTPError):
    return _error_response(e)

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def _validation_error(request, e):
    return _error_response(HTTPError(400, str(e)))

  @app.get("/health")
  async def health():
    if not served.runner.alive:
      return responses.JSONResponse(protocol.error_body(
          f"the engine is not running ({served.runner.error})", "server_error", code=503),
          status_code=503)
    return responses.Response(status_code=200)

  @app.get("/metrics")
  async def metrics():
    served.runner.metrics.asyncio_tasks.set(len(asyncio.all_tasks()))   # a leak shows here
    return responses.Response(served.runner.metrics.render(),
                              media_type="text/plain; version=0.0.4; charset=utf-8")

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{
        "id": served.model_name, "object": "model", "created": served.created,
        "owned_by": "paged_jax", "max_model_len": served.max_position}]}

  @app.post("/v1/completions")
  async def completions(request: fastapi.Request):
    req = await _parse(request, protocol.CompletionRequest)
    _check_model(served, req.model)
    try:
      req.check_supported()
      stops = req.stops
      prompts_in = req.prompts()
      if req.echo and req.logprobs is not None:
        raise ProtocolError("echo with logprobs needs the prompt's logprobs, which this engine "
                            "does not compute", "echo")
    except ProtocolError as e:
      raise HTTPError(400, str(e), param=e.param) from None
    prompts, texts = [], []
    for i, p in enumerate(prompts_in):
      if isinstance(p, str):
        if served.tokenizer is None:
          raise HTTPError(400, "a text prompt needs the model's tokenizer, and it has none: "
                               "send token ids", param="prompt")
        if not p:
          raise HTTPError(400, f"prompt {i} is empty", param="prompt")
        prompts.append(served.tokenizer.encode(p).ids)
        texts.append(p)
      else:
        prompts.append(list(p))
        texts.append(None)
    if req.echo:
      texts = [t if t is not None else "".join(_token_strings(served, p)) if served.tokenizer
               is None else served.tokenizer.decode(p) for t, p in zip(texts, prompts)]
    params = _sampling(req, req.max_tokens or 16, req.logprobs or 0)
    _check_capacity(served)
    job = _Job(served, prompts, params, stops,
               [t if req.echo else "" for t in texts])
    await job.start()
    rid, created, name = protocol.new_id("cmpl"), int(time.time()), served.model_name
    want_logprobs = req.logprobs is not None

    def logprobs_of(c: _Choice, co, start: int, end: int, text_offset: int):
      if not want_logprobs or co is None:
        return None
      strings = _token_strings(served, co.token_ids[start:end])
      tops = _tops(served, co.top_logprobs[start:end]) if co.top_logprobs is not None else None
      return protocol.completion_logprobs(strings, list(co.logprobs[start:end]), tops,
                                          text_offset)

    def usage():
      return protocol.usage(sum(len(p) for p in prompts),
                            sum(len(c.token_ids) for cs in job.choices for c in cs))

    latest = {}

    def make_chunks(moved):
      chunks = []
      for c, new, co in moved:
        if co is not None:
          latest[c.index] = co
        first, c.head_sent = not c.head_sent, True
        lp = logprobs_of(c, co, c.sent_tokens, len(c.token_ids),
                         len(c.prefix) + len(c.sent_text) - len(new))
        c.sent_tokens = len(c.token_ids)
        text = (c.prefix if first else "") + new
        if not text and lp is None and c.finish_reason is None:
          continue
        chunks.append(protocol.completion_chunk(rid, name, created, [{
            "index": c.index, "text": text, "logprobs": lp,
            "finish_reason": c.finish_reason if c.finish_reason != "error" else None}],
            include_usage=req.include_usage))
      return chunks

    def final_chunks():
      if not req.include_usage:
        return []
      return [protocol.completion_chunk(rid, name, created, [], usage(), True)]

    def make_body():
      choices = []
      for cs in job.choices:
        for c in cs:
          co = latest.get(c.index)
          choices.append({"index": c.index, "text": c.prefix + c.sent_text,
                          "logprobs": logprobs_of(c, co, 0, len(c.token_ids), len(c.prefix)),
                          "finish_reason": c.finish_reason})
      return protocol.completion_body(rid, name, choices, usage(), created)

    if not req.stream:   # collect the latest CompletionOutput of each choice for logprobs
      async def track():
        async for moved in job.updates():
          for c, _, co in moved:
            if co is not None:
              latest[c.index] = co
      return await _serve_collected(request, job, track, make_body)
    return _stream(job, make_chunks, final_chunks)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: fastapi.Request):
    req = await _parse(request, protocol.ChatCompletionRequest)
    _check_model(served, req.model)
    if served.chat is None:
      raise HTTPError(400, f"the model `{served.model_name}` has no chat template: use "
                           f"/v1/completions", param="messages")
    try:
      req.check_supported()
      stops = req.stops
      num_logprobs = req.num_logprobs
      messages = req.rendered_messages()
      prompt = served.chat.prompt_ids(messages)
    except ProtocolError as e:
      raise HTTPError(400, str(e), param=e.param) from None
    except chat_lib.ChatTemplateError as e:
      raise HTTPError(400, f"the chat template cannot render these messages: {e}",
                      param="messages") from None
    max_tokens = req.max_completion_tokens or req.max_tokens or max(
        1, served.max_position - len(prompt))
    params = _sampling(req, max_tokens, num_logprobs, served.chat.end_of_turn_ids)
    _check_capacity(served)
    job = _Job(served, [prompt], params, stops, [""])
    await job.start()
    rid, created, name = protocol.new_id("chatcmpl"), int(time.time()), served.model_name
    latest = {}

    def logprobs_of(co, start, end):
      if not req.logprobs or co is None:
        return None
      tops = (_tops(served, co.top_logprobs[start:end]) if co.top_logprobs is not None
              else None)
      return protocol.chat_logprobs(_token_strings(served, co.token_ids[start:end]),
                                    list(co.logprobs[start:end]), tops)

    def usage():
      return protocol.usage(len(prompt), sum(len(c.token_ids) for c in job.choices[0]))

    def make_chunks(moved):
      chunks = []
      for c, new, co in moved:
        if co is not None:
          latest[c.index] = co
        if not c.head_sent:
          c.head_sent = True
          chunks.append(protocol.chat_chunk(rid, name, created, [{
              "index": c.index, "delta": {"role": "assistant", "content": ""},
              "logprobs": None, "finish_reason": None}], include_usage=req.include_usage))
        lp = logprobs_of(co, c.sent_tokens, len(c.token_ids))
        c.sent_tokens = len(c.token_ids)
        if new or lp is not None:
          chunks.append(protocol.chat_chunk(rid, name, created, [{
              "index": c.index, "delta": {"content": new}, "logprobs": lp,
              "finish_reason": None}], include_usage=req.include_usage))
        if c.finish_reason is not None and c.finish_reason != "error":
          chunks.append(protocol.chat_chunk(rid, name, created, [{
              "index": c.index, "delta": {}, "logprobs": None,
              "finish_reason": c.finish_reason}], include_usage=req.include_usage))
      return chunks

    def final_chunks():
      if not req.include_usage:
        return []
      return [protocol.chat_chunk(rid, name, created, [], usage(), True)]

    def make_body():
      choices = [{"index": c.index,
                  "message": {"role": "assistant", "content": c.sent_text},
                  "logprobs": logprobs_of(latest.get(c.index), 0, len(c.token_ids)),
                  "finish_reason": c.finish_reason} for c in job.choices[0]]
      return protocol.chat_body(rid, name, choices, usage(), created)

    if not req.stream:
      async def track():
        async for moved in job.updates():
          for c, _, co in moved:
            if co is not None:
              latest[c.index] = co
      return await _serve_collected(request, job, track, make_body)
    return _stream(job, make_chunks, final_chunks)

  return app


async def _serve_collected(request: fastapi.Request, job: _Job, track, make_body):
  """Runs `track()` (which drains job.updates()) to the end and answers make_body(); aborts
  the job if the client disconnects first (499, never sent: nobody is listening)."""
  collector = asyncio.ensure_future(track())
  gone = asyncio.ensure_future(_disconnected(request))
  try:
    await asyncio.wait({collector, gone}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    gone.cancel()
    if not collector.done():   # the client left, or the server is stopping: stop its work
      collector.cancel()
      job.abort()
  if collector.cancelled() or not collector.done():
    return responses.Response(status_code=499)
  collector.result()
  errors = [c.error for cs in job.choices for c in cs if c.error]
  if errors:
    raise HTTPError(500, errors[0], "server_error")
  return responses.JSONResponse(make_body())
