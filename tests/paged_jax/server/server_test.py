"""The OpenAI-compatible server in a subprocess, driven by the official `openai` client.

The model is the embedded copy model (it copies its prompt's letters), served from a copy of its
directory that adds a chat template (the prompt's contents between <bos> and <sep>), so chat runs
through the same model. Every greedy or seeded result is compared with `Engine.generate` on the
same token ids in this process.
"""

import json
import os
import shutil
import tempfile
import threading
import time

from absl.testing import absltest
import httpx
import openai

from paged_jax import embedded, serve
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.sampling import SamplingParams
from paged_jax.server.process import ServerProcess

NUM_PAGES, PAGE_SIZE = 64, 16
TEMPLATE = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}<sep>"


def _metric(base: str, name: str, **labels) -> float:
  """One sample of /metrics (summed over label sets matching `labels`)."""
  total, found = 0.0, False
  for line in httpx.get(base + "/metrics").text.splitlines():
    if line.startswith(f"paged_jax:{name}") and not line.startswith("#"):
      head, value = line.rsplit(" ", 1)
      if head.split("{")[0] == f"paged_jax:{name}" and all(
          f'{k}="{v}"' in head for k, v in labels.items()):
        total, found = total + float(value), True
  if not found:
    raise KeyError(name)
  return total


class ServerTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.dir = tempfile.mkdtemp()
    model_dir = os.path.join(cls.dir, "copy-model")
    shutil.copytree(embedded.EMBEDDED_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
      f.write(TEMPLATE)
    cls.server = ServerProcess([f"--model={model_dir}", f"--num_pages={NUM_PAGES}",
                                f"--page_size={PAGE_SIZE}", "--program_store=",
                                "--compilation_cache=", "--max_num_seqs=16"]).start()
    cls.client = openai.OpenAI(base_url=cls.server.url, api_key="unused", max_retries=0,
                               timeout=60)
    params, cfg, cls.tokenizer, eos = serve.load_model(serve.ServeConfig(model_dir=model_dir))
    cls.engine = Engine(params, cfg, cache=CacheConfig(page_size=PAGE_SIZE, num_pages=NUM_PAGES),
                        tokenizer=cls.tokenizer, eos_token_ids=eos)

  @classmethod
  def tearDownClass(cls):
    cls.server.stop()
    shutil.rmtree(cls.dir, ignore_errors=True)
    super().tearDownClass()

  def complete(self, **kw):
    return self.client.completions.create(model=self.server.model, **kw)

  def reference(self, prompt, **params):
    ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else prompt
    return self.engine.generate([ids], SamplingParams(**params))[0]

  def test_models_and_health(self):
    models = self.client.models.list().data
    self.assertEqual([m.id for m in models], ["copy-model"])
    self.assertEqual(httpx.get(self.server.base + "/health").status_code, 200)

  def test_completions_equal_engine_generate(self):
    r = self.complete(prompt="h e l l o", max_tokens=8, temperature=0)
    ref = self.reference("h e l l o", max_tokens=8)
    self.assertEqual(r.choices[0].text, ref.outputs[0].text)
    # decoded after the prompt's last tokens (Engine._continuation): the word-level decoder's
    # space between the prompt and the copy opens the text, as vLLM's server writes it
    self.assertEqual(r.choices[0].text, " h e l l o")
    self.assertEqual(r.choices[0].finish_reason, ref.outputs[0].finish_reason)
    self.assertEqual(r.usage.prompt_tokens, len(ref.prompt_token_ids))
    self.assertEqual(r.usage.completion_tokens, len(ref.outputs[0].token_ids))
    # token ids and a list of prompts: one choice each, in order
    ids = self.tokenizer.encode("k v").ids
    r = self.complete(prompt=[ids, self.tokenizer.encode("p a g e").ids], max_tokens=8,
                      temperature=0)
    self.assertEqual([c.text for c in r.choices], [" k v", " p a g e"])
    self.assertEqual([c.index for c in r.choices], [0, 1])
    # seeded samples (temperature 1, n = 3): the engine's own tokens
    r = self.complete(prompt="c a c h e", max_tokens=10, temperature=1.0, n=3, seed=11,
                      logprobs=0, extra_body={"ignore_eos": True})
    ref = self.reference("c a c h e", max_tokens=10, temperature=1.0, n=3, seed=11,
                         ignore_eos=True)
    self.assertEqual([c.text for c in r.choices], [o.text for o in ref.outputs])
    for c, o in zip(r.choices, ref.outputs):
      self.assertSequenceAlmostEqual(c.logprobs.token_logprobs, o.logprobs, places=4)

  def test_ttft_is_its_queue_time_then_its_prefill_in_metrics(self):
    names = ("time_to_first_token_seconds", "request_queue_time_seconds",
             "request_prefill_time_seconds")
    read = lambda: {n: (_metric(self.server.base, n + "_count"),
                        _metric(self.server.base, n + "_sum")) for n in names}
    before = read()
    self.complete(prompt=["h e l l o", "k v"], max_tokens=4, temperature=0)
    after = read()
    (ttft_n, ttft_s), (queue_n, queue_s), (prefill_n, prefill_s) = (
        (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in names)
    self.assertEqual((ttft_n, queue_n, prefill_n), (2, 2, 2))
    self.assertGreater(queue_s, 0.0)
    self.assertGreater(prefill_s, 0.0)
    self.assertAlmostEqual(queue_s + prefill_s, ttft_s, places=6)

  def test_seeds_reproduce_across_calls_and_streamed_text_equals_the_response(self):
    kw = dict(prompt="s e e d", max_tokens=12, temperature=1.5, n=2,
              extra_body={"ignore_eos": True, "top_k": 10})
    texts = {}
    for seed in (1, 1, 2, 3, 4):
      r = self.complete(seed=seed, **kw)
      texts.setdefault(seed, []).append(tuple(c.text for c in r.choices))
    self.assertEqual(texts[1][0], texts[1][1])
    self.assertGreater(len({t[0] for t in texts.values()}), 1)   # seeds 1-4 not all the same
    streamed = ["", ""]
    usage = None
    for chunk in self.complete(seed=1, stream=True, stream_options={"include_usage": True}, **kw):
      for c in chunk.choices:
        streamed[c.index] += c.text
      if chunk.usage is not None:
        usage = chunk.usage
    self.assertEqual(tuple(streamed), texts[1][0])
    self.assertEqual((usage.prompt_tokens, usage.completion_tokens), (6, 24))

  def test_logprobs_and_stop_strings(self):
    r = self.complete(prompt="h e l l o", max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ref = self.reference("h e l l o", max_tokens=8, logprobs=3).outputs[0]
    self.assertEqual(len(lp.tokens), len(ref.token_ids))
    self.assertTrue(all(len(t) == 3 for t in lp.top_logprobs))
    self.assertSequenceAlmostEqual(lp.token_logprobs, ref.logprobs, places=4)
    self.assertEqual(lp.text_offset[:3], [0, 1, 2])
    # A stop string cuts the text before it, streamed or not.
    r = self.complete(prompt="h e l l o", max_tokens=8, temperature=0, stop=["l l"])
    self.assertEqual((r.choices[0].text, r.choices[0].finish_reason), (" h e ", "stop"))
    text = "".join(c.choices[0].text for c in self.complete(
        prompt="h e l l o", max_tokens=8, temperature=0, stop="l l", stream=True))
    self.assertEqual(text, " h e ")
    r = self.complete(prompt="a b", max_tokens=8, temperature=0, echo=True)
    self.assertEqual(r.choices[0].text, "a b" + " a b")

  def test_chat_through_the_template(self):
    messages = [{"role": "user", "content": "h i"}]
    r = self.client.chat.completions.create(model=self.server.model, messages=messages,
                                            temperature=0, max_tokens=10)
    ids = self.tokenizer.encode("<bos>h i<sep>", add_special_tokens=False).ids
    ref = self.engine.generate([ids], SamplingParams(max_tokens=10))[0].outputs[0]
    self.assertEqual(r.choices[0].message.content, ref.text)
    self.assertEqual(r.choices[0].message.role, "assistant")
    chunks = list(self.client.chat.completions.create(
        model=self.server.model, messages=messages, temperature=0, max_tokens=10, stream=True))
    self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
    self.assertEqual("".join(c.choices[0].delta.content or "" for c in chunks), ref.text)
    self.assertEqual(chunks[-1].choices[0].finish_reason, r.choices[0].finish_reason)

  def test_bad_requests_get_named_errors_while_good_ones_are_served(self):
    url = self.server.url + "/completions"
    name = self.server.model
    good = {"model": name, "prompt": "g o o d", "max_tokens": 6, "temperature": 0}
    bad = [
        (b'{"prompt": "a",', 400, "not JSON"),
        (b'\xff\xfe{"prompt": 1}', 400, "not UTF-8"),
        (b'[1, 2]', 400, "must be a JSON object"),
        (json.dumps({**good, "max_tokens": "many"}), 400, "max_tokens"),
        (json.dumps({**good, "prompt": [1, 2, 99]}), 400, "outside [0, 32): [99]"),
        (json.dumps({**good, "prompt": "a " * 130, "max_tokens": 2}), 400, "max_position=128"),
        (json.dumps({**good, "n": 17}), 400, "n=17 exceeds max_num_seqs=16"),
        (json.dumps({**good, "n": 16, "max_tokens": 100, "prompt": "a b c"}), 400,
         "it can never fit"),
        (json.dumps({**good, "model": "gpt-9"}), 404, "`gpt-9` does not exist"),
        (json.dumps({**good, "presence_penalty": 1}), 400, "presence_penalty=1"),
    ]
    results = {}

    def send(key, body):
      results[key] = httpx.post(url, content=body, headers={"Content-Type": "application/json"},
                                timeout=60)
    threads = [threading.Thread(target=send, args=(("good", i), json.dumps(good)))
               for i in range(3)]
    threads += [threading.Thread(target=send, args=(("bad", i), body))
                for i, (body, _, _) in enumerate(bad)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    for i, (_, status, message) in enumerate(bad):
      r = results[("bad", i)]
      self.assertEqual(r.status_code, status, r.text)
      self.assertIn(message, r.json()["error"]["message"])
    for i in range(3):
      self.assertEqual(results[("good", i)].json()["choices"][0]["text"], " g o o d")
    with self.assertRaises(openai.NotFoundError):   # the client raises the API's error types
      self.client.completions.create(model="nope", prompt="a", max_tokens=1)

  def test_a_disconnected_stream_is_aborted_and_its_pages_freed(self):
    aborted = self._aborted()
    with httpx.stream("POST", self.server.url + "/completions", timeout=60, json={
        "model": self.server.model, "prompt": "a b c d", "max_tokens": 110, "temperature": 1,
        "ignore_eos": True, "stream": True}) as r:
      lines = r.iter_lines()
      first = next(line for line in lines if line.startswith("data:"))
      self.assertIn('"text"', first)
      self.assertGreater(_metric(self.server.base, "kv_pages_in_use"), 0)
    # the server notices the closed connection and aborts; wait for its next step to show it
    deadline = time.monotonic() + 30
    while self._aborted() == aborted and time.monotonic() < deadline:
      time.sleep(0.05)
    self.assertEqual(self._aborted(), aborted + 1)
    self.assertEqual(_metric(self.server.base, "kv_pages_in_use"), 0)
    self.assertEqual(_metric(self.server.base, "num_open_requests"), 0)
    self.assertGreaterEqual(_metric(self.server.base, "num_programs"), 1)   # it ran a step
    # no --warmup: every program was compiled while a request waited
    self.assertEqual(_metric(self.server.base, "num_programs_on_demand"),
                     _metric(self.server.base, "num_programs"))
    # timed only with a program store (here jit compiles inside the step's own call)
    self.assertEqual(_metric(self.server.base, "programs_on_demand_seconds"), 0.0)
    self.assertGreaterEqual(_metric(self.server.base, "server_asyncio_tasks"), 1)   # this scrape

  def _aborted(self) -> float:
    try:
      return _metric(self.server.base, "request_success_total", finished_reason="abort")
    except KeyError:
      return 0.0

  def test_zz_sigterm_lets_open_streams_finish_then_exits_0(self):
    # Last (absltest runs a class's tests in name order): it stops the server.
    stream = iter(self.complete(prompt="e n d", max_tokens=60, temperature=1, stream=True,
                                extra_body={"ignore_eos": True}))
    next(stream)
    self.server.proc.send_signal(15)
    rest = list(stream)
    self.assertEqual(rest[-1].choices[0].finish_reason, "length")
    self.assertEqual(self.server.proc.wait(timeout=60), 0)
    self.assertIn("paged_jax.server: stopped", self.server.output)


if __name__ == "__main__":
  absltest.main()
