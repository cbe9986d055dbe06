"""The app and the engine thread in-process, over a fake engine (no model): the waiting bound
and a failing engine loop."""

import os
import re
import subprocess
import sys
import threading

from absl.testing import absltest
from fastapi.testclient import TestClient

from paged_jax.host.sequence import CompletionOutput, RequestOutput
from paged_jax.server import EngineRunner, Metrics, Served, create_app


class FakeEngine:
  """One token per step for each request; `waiting` reports that many queued; `fail` makes
  step raise."""

  def __init__(self, waiting=0, fail=False):
    self.waiting, self.fail = waiting, fail
    self.requests = {}
    self.lock = threading.Lock()
    self.asked = []   # what `interrupt` answered, asked before and after `on_step` ran
    self.on_step = None

  def add_request(self, prompt, params, arrival_time=None):
    rid = f"r{len(self.requests)}"
    self.requests[rid] = (list(prompt), params, [])
    return rid

  def abort(self, rid):
    return self.requests.pop(rid, None) is not None

  def has_unfinished(self):
    return bool(self.requests)

  def step(self, interrupt=None):
    if self.fail:
      raise RuntimeError("bookkeeping bug")
    if self.on_step is not None:
      self.asked.append(interrupt())
      self.on_step()
      self.asked.append(interrupt())
      self.on_step = None
    outs = []
    for rid, (prompt, params, toks) in list(self.requests.items()):
      toks.append(7)
      done = len(toks) >= params.max_tokens
      outs.append(RequestOutput(rid, prompt, [CompletionOutput(
          0, list(toks), [7], None, None, [0.0] * len(toks), None, 0.0, 0.0,
          "length" if done else None)], done, 0.0, 0.1, 0.01, 1.0 if done else None))
      if done:
        del self.requests[rid]
    return outs

  def gauges(self):
    return {"waiting": self.waiting, "running": len(self.requests), "swapped": 0,
            "pages_in_use": len(self.requests), "pages_cached_idle": 0, "pages_usable": 8,
            "swap_copies": 0, "prefix_queries_tokens": 0, "prefix_hits_tokens": 0,
            "preemptions": 0, "programs": 1, "programs_on_demand": 1,
            "programs_on_demand_s": 0.0, "rounds_stopped": sum(self.asked)}


def _client(engine, **kw):
  runner = EngineRunner(engine, Metrics("fake"))
  runner.start()
  return TestClient(create_app(Served(runner, model_name="fake", **kw))), runner


class AppTest(absltest.TestCase):

  def test_token_prompts_served_and_max_waiting_refuses_with_503(self):
    client, _ = _client(FakeEngine(waiting=1), max_waiting=2)
    with client:
      r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
      self.assertEqual(r.status_code, 200, r.text)
      self.assertEqual(r.json()["usage"]["completion_tokens"], 3)
    client, _ = _client(FakeEngine(waiting=2), max_waiting=2)
    with client:
      r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
      self.assertEqual(r.status_code, 503)
      self.assertIn("2 requests are waiting", r.json()["error"]["message"])
      self.assertIn("--max_waiting=2", r.json()["error"]["message"])
      self.assertEqual(r.json()["error"]["type"], "server_overloaded")

  def test_a_failing_engine_loop_fails_its_requests_and_health(self):
    client, runner = _client(FakeEngine(fail=True))
    with client:
      self.assertEqual(client.get("/health").status_code, 200)
      r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
      self.assertEqual(r.status_code, 500)
      self.assertIn("bookkeeping bug", r.json()["error"]["message"])
      self.assertEqual(client.get("/health").status_code, 503)
      r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
      self.assertEqual(r.status_code, 503)   # refused at once, nothing queued
      self.assertIn("not running", r.json()["error"]["message"])

  def test_a_queued_command_interrupts_the_engine_step(self):
    # The engine thread asks "is a command queued?" between a stoppable round's steps: no
    # before a request arrives, yes once one is queued (here: an abort sent mid-step).
    engine = FakeEngine()
    client, runner = _client(engine)
    engine.on_step = lambda: runner.abort("r-unknown")
    with client:
      r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
      self.assertEqual(r.status_code, 200, r.text)
      self.assertIn('paged_jax:num_rounds_stopped_total{model_name="fake"} 1.0',
                    client.get("/metrics").text)
    self.assertEqual(engine.asked, [False, True])

  def test_the_server_runs_stoppable_rounds_with_no_link_ahead_by_default(self):
    # `python -m paged_jax.server` sets its own defaults; the serve command keeps scan rounds
    # and one link ahead (absl's --helpfull prints every flag with its default, then exits 1).
    def defaults(module):
      out = subprocess.run([sys.executable, "-m", module, "--helpfull"], capture_output=True,
                           text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
      found = {}
      for flag in ("--[no]stoppable_rounds:", "--links_ahead:"):
        (line,) = [ln for ln in out.splitlines() if ln.strip().startswith(flag)]
        found[flag] = re.search(r"\(default: '(\w+)'\)", out[out.index(line):]).group(1)
      return found
    self.assertEqual(defaults("paged_jax.server"),
                     {"--[no]stoppable_rounds:": "true", "--links_ahead:": "0"})
    self.assertEqual(defaults("paged_jax.serve"),
                     {"--[no]stoppable_rounds:": "false", "--links_ahead:": "1"})

  def test_text_prompt_without_a_tokenizer_and_chat_without_a_template(self):
    client, _ = _client(FakeEngine())
    with client:
      r = client.post("/v1/completions", json={"prompt": "hi"})
      self.assertEqual(r.status_code, 400)
      self.assertIn("needs the model's tokenizer", r.json()["error"]["message"])
      r = client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                   "content": "hi"}]})
      self.assertEqual(r.status_code, 400)
      self.assertIn("has no chat template", r.json()["error"]["message"])


if __name__ == "__main__":
  absltest.main()
