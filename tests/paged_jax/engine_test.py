"""The engine end to end in f32 on a tiny random model: greedy tokens equal dense decoding under
preemption (swap and recompute), prefix caching on and off, n > 1, beam search against a plain
dense beam search, seeded sampling independent of the batch, streaming, abort, and the engine
issue's regressions (6b, 6c, 6d)."""

import collections

from absl.testing import absltest, parameterized
import numpy as np

from paged_jax import config, generate, page_ops, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

CFG = config.tiny_config()
PARAMS = testing.random_params(CFG, seed=0, scale=0.3)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5], [42], [5, 6, 7, 8, 9, 10, 11]]
dense = testing.DenseGreedy(PARAMS, CFG)


def make(num_pages=80, page_size=4, caching=True, **sched):
  return Engine(PARAMS, CFG, cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                                               enable_prefix_caching=caching),
                scheduler=SchedulerConfig(**sched), impl="xla")


def finish(test, engine):
  engine.bm.check_invariants()
  stats = engine.bm.stats()
  test.assertEqual(stats["pages_in_use"], 0)   # nothing leaked
  test.assertEqual(stats["pages_free"] + stats["pages_cached_idle"], engine.num_pages - 1)


class GreedyEqualsDenseTest(parameterized.TestCase):

  @parameterized.product(mode=("recompute", "swap"), caching=(True, False))
  def test_under_preemption(self, mode, caching):
    # 13 usable pages of 2 tokens for five sequences of up to 9 + 10 tokens: preemption.
    e = make(num_pages=14, page_size=2, caching=caching, preemption_mode=mode,
             steps_per_sync=3, max_num_batched_tokens=8, max_num_seqs=8)
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=10))
    self.assertEqual([o.outputs[0].token_ids for o in outs], [dense(p, 10) for p in PROMPTS])
    self.assertGreater(e.stats.preemptions, 0)
    if mode == "swap":
      self.assertGreater(e.stats.swapped_in_pages, 0)
    else:
      self.assertGreater(e.stats.recomputed_tokens, 0)
    finish(self, e)

  def test_prefix_cache_hits_and_arrivals_between_steps(self):
    e = make()
    shared = [5, 6, 7, 8, 9, 10, 11, 12]   # two full pages
    first = e.add_request(shared + [1], SamplingParams(max_tokens=6))
    e.step()
    e.step()
    later = [e.add_request(shared + [2, 3], SamplingParams(max_tokens=6)),
             e.add_request(shared + [4], SamplingParams(max_tokens=6))]
    final = {o.request_id: o for o in e.stream() if o.finished}
    self.assertEqual(e.stats.cached_prompt_tokens, 16)   # 8 tokens hit, twice
    for rid, prompt in zip([first] + later, [shared + [1], shared + [2, 3], shared + [4]]):
      self.assertEqual(final[rid].outputs[0].token_ids, dense(prompt, 6))
    self.assertGreater(e.metrics()["prefix_hit_rate"], 0)
    finish(self, e)

  def test_parallel_samples_greedy_equal_dense_and_share_pages(self):
    e = make(steps_per_sync=2)
    prompt = [3, 1, 4, 1, 5, 9, 2]   # partial last page: every sample but one copies it
    out, = e.generate([prompt], SamplingParams(max_tokens=8, n=3))
    self.assertEqual([c.token_ids for c in out.outputs], [dense(prompt, 8)] * 3)
    self.assertEqual(e.stats.cow_copies, 2)
    finish(self, e)


class BeamSearchTest(parameterized.TestCase):

  @parameterized.parameters((2, 1.0, 1), (3, 0.5, 3), (4, 1.0, 2))
  def test_matches_plain_dense_beam_search(self, width, penalty, n):
    eos = 7
    e = Engine(PARAMS, CFG, cache=CacheConfig(page_size=4, num_pages=60), impl="xla",
               eos_token_ids=[eos])
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]]
    params = SamplingParams(max_tokens=6, beam_width=width, length_penalty=penalty, n=n)
    outs = e.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
      ref = testing.dense_beam_search(PARAMS, CFG, prompt, beam_width=width, max_tokens=6,
                                      length_penalty=penalty, eos_ids=[eos], n=n)
      self.assertEqual([c.token_ids for c in out.outputs], ref)
      scores = [c.score for c in out.outputs]
      self.assertEqual(scores, sorted(scores, reverse=True))
    finish(self, e)

  def test_beams_share_pages(self):
    # While beams run, they share the prompt's pages and every page up to their divergence.
    e = Engine(PARAMS, CFG, cache=CacheConfig(page_size=4, num_pages=60), impl="xla")
    e.add_request(list(range(1, 17)), SamplingParams(max_tokens=8, beam_width=4))
    peak_shared = 0
    while e.has_unfinished():
      e.step()
      tables = [e.bm.block_table(s.seq_id) for g in e.scheduler.running for s in g.seqs]
      if tables:
        pages = [p for t in tables for p in t]
        peak_shared = max(peak_shared, len(pages) - len(set(pages)))
    self.assertGreaterEqual(peak_shared, 3 * 4)   # 4 prompt pages shared by 4 beams at least
    finish(self, e)


class SamplingTest(parameterized.TestCase):

  def test_seeded_requests_do_not_depend_on_the_batch(self):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=1234)
    alone = make().generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=5, temperature=0.7, seed=s) for s in range(4)]
    mixed = make(steps_per_sync=1).generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:],
                                            others[:2] + [params] + others[2:])
    self.assertEqual(mixed[2].outputs[0].token_ids, alone)
    reseeded = make().generate([PROMPTS[2]], SamplingParams(**{**params.__dict__, "seed": 99}))
    self.assertNotEqual(reseeded[0].outputs[0].token_ids, alone)

  def test_samples_of_one_request_differ(self):
    out = make().generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=1.5, n=4,
                                                       seed=3))[0]
    self.assertLen({tuple(c.token_ids) for c in out.outputs}, 4)

  def test_logprobs_match_the_dense_model(self):
    out = make().generate([PROMPTS[1]], SamplingParams(max_tokens=4, logprobs=3))[0].outputs[0]
    tokens = list(PROMPTS[1])
    for t, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
      ref = testing.dense_logprobs(PARAMS, CFG, tokens)
      self.assertAlmostEqual(lp, float(ref[t]), places=4)
      self.assertEqual(list(top), list(np.argsort(-ref)[:3]))
      np.testing.assert_allclose(list(top.values()), np.sort(ref)[::-1][:3], atol=1e-4)
      tokens.append(t)
    self.assertAlmostEqual(out.cumulative_logprob, sum(out.logprobs), places=5)


class RegressionTest(absltest.TestCase):

  def test_6b_a_request_that_can_never_fit_is_refused_and_one_that_fits_runs(self):
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]]
    g = generate.Generator(PARAMS, CFG, num_pages=5, page_size=4, steps_per_sync=1, impl="xla")
    # Prompt 1 with n = 2 and 3 new tokens holds up to 5 pages (3 per sample, 1 shared): more
    # than the 4 usable ones, so it could never run. Refused up front, by name, nothing queued.
    with self.assertRaisesRegex(ValueError, "prompt 1: .*needs up to 5 pages.*the pool has 4"):
      g.generate(prompts, 3, n=2)
    self.assertFalse(g.engine.has_unfinished())
    # One page more and both run; request 1 preempts nothing it cannot and everything finishes.
    g = generate.Generator(PARAMS, CFG, num_pages=6, page_size=4, steps_per_sync=1, impl="xla")
    out = g.generate(prompts, 3, n=2)
    self.assertEqual(out, [dense(prompts[0], 3)] * 2 + [dense(prompts[1], 3)] * 2)
    finish(self, g.engine)

  def test_6c_copy_batches_are_conflict_free_and_outputs_exact(self):
    seen = []
    original = page_ops.check_copy_batch

    def spy(src, dst):
      seen.append(list(zip(src.tolist(), dst.tolist())))
      original(src, dst)   # raises on a conflict

    page_ops.check_copy_batch = spy
    self.addCleanup(setattr, page_ops, "check_copy_batch", original)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    g = generate.Generator(PARAMS, CFG, num_pages=7, page_size=4, impl="xla")
    out = g.generate(prompts, 3, n=3)
    # The old loop queued (2, 5), (2, 6), (4, 2), (4, 6) in one batch and request 1's samples
    # came out wrong ([53, 38, 29] where dense decoding gives [53, 38, 33]).
    self.assertEqual(out, [dense(prompts[0], 3)] * 3 + [dense(prompts[1], 3)] * 3)
    self.assertNotEmpty(seen)
    finish(self, g.engine)

  def test_swapped_before_its_first_sample_a_request_still_samples_n(self):
    # Found by the isolation test (issue 10): a prompt sampled n times that was swapped out
    # between its prefill and its first sample came back with one completion, not n.
    e = make(num_pages=14, page_size=2, preemption_mode="swap", steps_per_sync=3,
             max_num_batched_tokens=12, max_num_seqs=8)
    params = [SamplingParams(max_tokens=10)] * 3 + [SamplingParams(max_tokens=10, n=2)]
    prompts = PROMPTS[:3] + [[11, 12, 13, 14, 15, 16]]
    outs = e.generate(prompts, params)
    self.assertGreater(e.stats.swapped_in_pages, 0)
    self.assertEqual([len(o.outputs) for o in outs], [1, 1, 1, 2])
    self.assertEqual([c.token_ids for c in outs[3].outputs], [dense(prompts[3], 10)] * 2)
    finish(self, e)

  def test_6d_several_eos_ids_all_stop(self):
    prompt = PROMPTS[0]
    ref = dense(prompt, 9)
    first = {}
    for i, t in enumerate(ref):
      first.setdefault(t, i)
    (a, i_a), (b, i_b) = sorted(first.items(), key=lambda kv: kv[1])[1:3]   # two distinct tokens
    g = generate.Generator(PARAMS, CFG, num_pages=40, page_size=4, impl="xla")
    self.assertEqual(g.generate([prompt], 9, eos_id=[b, a]), [ref[:i_a + 1]])
    self.assertEqual(g.generate([prompt], 9, eos_id=(b,)), [ref[:i_b + 1]])
    e = Engine(PARAMS, CFG, cache=CacheConfig(page_size=4, num_pages=40), impl="xla",
               eos_token_ids=[b, a])
    out = e.generate([prompt], SamplingParams(max_tokens=9))[0].outputs[0]
    self.assertEqual((out.token_ids, out.finish_reason), (ref[:i_a + 1], "stop"))
    out = e.generate([prompt], SamplingParams(max_tokens=9, ignore_eos=True))[0].outputs[0]
    self.assertEqual((out.token_ids, out.finish_reason), (ref, "length"))
    with self.assertRaisesRegex(ValueError, r"eos_token_ids has token ids outside \[0, 64\)"):
      Engine(PARAMS, CFG, cache=CacheConfig(num_pages=8), eos_token_ids=[64])


class EngineTest(absltest.TestCase):

  def test_streaming_and_abort(self):
    e = make(steps_per_sync=2)
    ids = [e.add_request(p, SamplingParams(max_tokens=8)) for p in PROMPTS]
    pieces: dict = {}
    final = {}
    steps = 0
    for out in e.stream():
      steps += 1
      pieces.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
      if out.finished:
        final[out.request_id] = out
      if steps == 3:
        self.assertTrue(e.abort(ids[4]))
    for i, p in zip(ids[:4], PROMPTS):
      self.assertEqual(pieces[i], final[i].outputs[0].token_ids)
      self.assertEqual(final[i].outputs[0].token_ids, dense(p, 8))
      self.assertGreater(final[i].ttft, 0)
      self.assertGreater(final[i].tpot, 0)
    self.assertEqual(final[ids[4]].outputs[0].finish_reason, "abort")
    self.assertEqual(pieces[ids[4]], final[ids[4]].outputs[0].token_ids)
    finish(self, e)

  def test_pool_from_a_memory_budget(self):
    cache = CacheConfig(page_size=4, memory_bytes=1 << 20)
    per_page = 2 * CFG.num_layers * 4 * CFG.num_kv_heads * CFG.head_dim * 4
    e = Engine(PARAMS, CFG, cache=cache, impl="xla")
    self.assertEqual(e.num_pages, (1 << 20) // per_page)
    self.assertEqual(e.capacity_tokens, (e.num_pages - 1) * 4)
    self.assertEqual(e.pool.nbytes, e.num_pages * per_page)
    with self.assertRaisesRegex(ValueError, "memory_fraction=0.5 needs a device that reports"):
      Engine(PARAMS, CFG, cache=CacheConfig(memory_fraction=0.5))
    with self.assertRaisesRegex(ValueError, "set one of num_pages"):
      CacheConfig(num_pages=4, memory_bytes=10)
    self.assertEqual(CacheConfig(page_size=4).resolve_num_pages(
        CFG, {"bytes_limit": 10 * per_page, "bytes_in_use": 0}), 9)   # 0.9 of what is free

  def test_host_params_are_put_on_the_device_once(self):
    # NumPy params (a GGUF file's tensors) left on the host are copied in by every step.
    import jax
    host = jax.tree.map(np.asarray, PARAMS)
    e = Engine(host, CFG, cache=CacheConfig(page_size=4, num_pages=16), impl="xla")
    self.assertTrue(all(isinstance(x, jax.Array) for x in jax.tree.leaves(e.params)))
    self.assertEqual(e.generate([PROMPTS[0]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids,
                     dense(PROMPTS[0], 3))

  def test_text_with_the_embedded_tokenizer(self):
    from paged_jax import embedded
    params, cfg, tok = embedded.load_embedded()
    e = Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=40), tokenizer=tok,
               eos_token_ids=[embedded.EOS], impl="xla")
    prompt = tok.encode("h e l l o").ids   # the tokenizer frames it: <bos> h e l l o <sep>
    self.assertEqual((prompt[0], prompt[-1], len(prompt)), (embedded.BOS, embedded.SEP, 7))
    e.add_request(prompt, SamplingParams(max_tokens=12))
    text = ""
    for out in e.stream():
      text += out.outputs[0].new_text
    self.assertEqual(out.outputs[0].token_ids[-1], embedded.EOS)   # the ids keep EOS ...
    self.assertEqual(out.outputs[0].text, text)
    self.assertEqual(text.replace(" ", ""), "hello")               # ... the text does not


class ContinuationTextTest(absltest.TestCase):
  """Engine._continuation on stand-in tokenizers (no model): a completion's text is what its
  tokens add after the prompt's last tokens."""

  def _text(self, decode, prompt, tokens):
    import types
    host = types.SimpleNamespace(tokenizer=types.SimpleNamespace(decode=decode))
    g = types.SimpleNamespace(prompt=tuple(prompt), context_text=None)
    return Engine._continuation(host, g, list(tokens))

  def test_a_word_joining_decoder_keeps_the_first_space(self):
    words = {1: "the", 2: "cat", 3: "sat", 4: "down"}
    decode = lambda ids: " ".join(words[i] for i in ids)
    self.assertEqual(self._text(decode, [1, 2], [3, 4]), " sat down")
    self.assertEqual(decode([1, 2]) + self._text(decode, [1, 2], [3, 4]), decode([1, 2, 3, 4]))
    self.assertEqual(self._text(decode, [1, 2], []), "")
    self.assertEqual(self._text(decode, [], [3]), "sat")   # no prompt: the tokens alone

  def test_a_character_split_at_the_boundary_decodes_the_tokens_alone(self):
    # bytes decoded as UTF-8 with replacement: the prompt ends inside "é" (0xc3 0xa9)
    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b"!"}
    decode = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
    self.assertEqual(decode([1, 2]), "caf\ufffd")
    self.assertEqual(self._text(decode, [1, 2], [3, 4]), decode([3, 4]))   # not "é!"-shifted
    self.assertEqual(self._text(decode, [1], [2, 3, 4]), "é!")


class WarmupTest(absltest.TestCase):

  def test_one_user_after_warmup_compiles_nothing(self):
    # Warmed for one user, a chat of turns (a later turn reuses the earlier one's pages as a
    # cached prefix; one turn samples) runs only warmed programs: JAX traces and compiles
    # nothing while it serves, and the tokens are those of the engine without warmup.
    import jax
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: events.append(name) if watching else None)
    watching = False
    sched = dict(max_num_batched_tokens=128, steps_per_sync=3, max_num_seqs=2)   # 6 programs
    first = [t % 64 for t in range(1, 30)]
    turns = [(first, SamplingParams(max_tokens=8)),
             (first + [t % 64 for t in range(40, 140)], SamplingParams(max_tokens=5)),
             ([3] * 70, SamplingParams(max_tokens=6, temperature=0.9, seed=1))]
    out = {}
    for warm in (False, True):
      e = make(num_pages=200, **sched)
      if warm:
        report = e.warmup("one_user")
        self.assertEqual(report["compiled"], report["programs"])
        self.assertEqual(e.warmup("one_user")["compiled"], 0)   # nothing twice
        watching = True
      out[warm] = [e.generate([p], sp)[0].outputs[0].token_ids for p, sp in turns]
      watching = False
      # a step waited for every program without warmup (jit compiled it), for none with it
      self.assertEqual(e.metrics()["programs_on_demand"], 0 if warm else e.metrics()["programs"])
      self.assertEqual(e.metrics()["programs_on_demand_s"], 0.0)   # timed with a store only
    self.assertGreater(e.metrics()["cached_prompt_tokens"], 0)
    self.assertEqual(e.metrics()["programs_not_warmed"], 0)
    # prefill of 32 tokens, of the second turn's 100 uncached ones (112) and of 70 (80); a round
    self.assertEqual(e.metrics()["programs"], 4)
    self.assertEqual([n for n in events if "compile" in n or "trace" in n], [])
    self.assertEqual(out[True], out[False])
    with self.assertRaisesRegex(ValueError, "scope='most' is not"):
      e.warmup("most")

  def test_scopes_nest(self):
    # one_user < one_prompt (adds steps that prefill one prompt beside decode rows) < all.
    from paged_jax import engine as engine_lib
    e = make(num_pages=64, max_num_batched_tokens=128, max_num_seqs=4, steps_per_sync=3)
    one_user, one_prompt, every = (set(e.warmup_programs(s)) for s in engine_lib.WARMUP_SCOPES)
    self.assertLess(one_user, one_prompt)
    self.assertLess(one_prompt, every)
    self.assertTrue(all(k.num_prefill_rows <= 4 for k in one_prompt))

  def test_programs_are_dropped_before_the_map_limit(self):
    # Each compiled kernel holds its own memory maps; near vm.max_map_count the engine drops
    # its least recently used programs (and JAX's caches), and a dropped one compiles again.
    from unittest import mock
    from paged_jax import program_store
    sched = dict(max_num_batched_tokens=80, steps_per_sync=3, max_num_seqs=2)
    prompt, sp = [t % 64 for t in range(1, 30)], SamplingParams(max_tokens=8)
    e = make(num_pages=200, **sched)
    want = e.generate([prompt], sp)[0].outputs[0].token_ids
    e.warmup("one_user")
    keys = list(e._compiled)   # oldest first
    self.assertEqual(len(keys), 8)   # prefill buckets 16-80, rounds of 1 and 2, decode 1 and 8
    sizes = [k.num_decode + k.num_prefill_tokens for k in keys]
    self.assertEqual(sizes, sorted(sizes, reverse=True))   # the small ones last: they stay
    maps = lambda: 100 + 300 * len(e._compiled)   # noqa: E731  (a simulated process)
    with mock.patch.object(program_store, "map_limit", lambda: 4_000), \
         mock.patch.object(program_store, "mapped_regions", maps):
      self.assertEqual(e._bound_maps(keep=keys[0]), 0)   # 2,500 of 4,000: nothing
    with mock.patch.object(program_store, "map_limit", lambda: 2_000), \
         mock.patch.object(program_store, "mapped_regions", maps):
      # 2,500 > 1,500: the older half of the 7 others goes (3), 1,600 > 1,000: 2 of the 4
      # left; 1,000 is not above 1,000. keys[0], the one just run, stays.
      self.assertEqual(e._bound_maps(keep=keys[0]), 5)
      self.assertEqual(list(e._compiled), [keys[0], keys[6], keys[7]])
      self.assertEqual(e.metrics()["evicted_programs"], 5)
    # Least recently used first: what a request just ran outlives what it did not.
    e.warmup("one_user")
    calls, order = collections.Counter(e.programs), list(e._compiled)
    self.assertEqual(e.generate([prompt], sp)[0].outputs[0].token_ids, want)
    used = {k for k in e.programs if e.programs[k] > calls[k]}
    self.assertBetween(len(used), 1, 2)
    self.assertTrue(used & set(order[:3]))   # one of them was among the 3 oldest before
    with mock.patch.object(program_store, "map_limit", lambda: 2_000), \
         mock.patch.object(program_store, "mapped_regions", maps):
      self.assertEqual(e._bound_maps(), 6)   # 2,500: 4 of 8 go, 1,300: 2 of 4; 2 stay
    self.assertLessEqual(used, set(e._compiled))
    # Really: dropping every program and JAX's caches gives this process's maps back.
    before = program_store.mapped_regions()
    if before is None:
      self.skipTest("no /proc/self/maps here")
    with mock.patch.object(program_store, "MAPS_HIGH", 0.0), \
         mock.patch.object(program_store, "MAPS_LOW", 0.0):
      self.assertGreater(e._bound_maps(), 0)
    self.assertEqual(e._compiled, {})
    self.assertLess(program_store.mapped_regions(), before - 50)
    self.assertEqual(e.generate([prompt], sp)[0].outputs[0].token_ids, want)

  def _store_engines(self, num_layers, impl="xla"):
    # A model of its own per test: XLA:CPU cannot serialize an executable that has already run
    # (a sort's `LessThan`), which jit hands back for a program this process compiled before.
    import tempfile
    store = tempfile.mkdtemp()
    cfg = config.tiny_config(num_layers=num_layers)
    params = testing.random_params(cfg, seed=num_layers, scale=0.3)
    sched = SchedulerConfig(steps_per_sync=3, max_num_seqs=1, max_num_batched_tokens=64)
    new = lambda: Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=40),
                         scheduler=sched, impl=impl, program_store=store)
    return store, new, testing.DenseGreedy(params, cfg)

  def test_a_restart_loads_its_programs_from_the_store(self):
    # The first engine compiles what it meets and stores it; a second one (a restarted
    # process) loads those programs, traces and compiles nothing, and gives the same tokens.
    import jax
    import os
    store, new, ref = self._store_engines(3)
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: events.append(name) if watching else None)
    watching = False
    prompt, sp = [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=7)
    first = new()
    want = first.generate([prompt], sp)[0].outputs[0].token_ids
    self.assertEqual(want, ref(prompt, 7))
    m = first.metrics()
    self.assertEqual((m["programs_compiled"], m["programs_loaded"]), (2, 0))
    self.assertLen(os.listdir(store), 2)
    second = new()
    watching = True
    self.assertEqual(second.generate([prompt], sp)[0].outputs[0].token_ids, want)
    watching = False
    m = second.metrics()
    self.assertEqual((m["programs_compiled"], m["programs_loaded"]), (0, 2))
    self.assertEqual(m["programs_on_demand"], 2)   # loaded while a step waited
    self.assertGreater(m["programs_on_demand_s"], 0.0)   # and how long it waited
    self.assertEqual([n for n in events if "compile" in n or "trace" in n], [])
    # Near the map limit a program loaded on demand counts too: the prefill's program is
    # dropped after the round's is loaded (a simulated process at 90 of 100 maps).
    from unittest import mock
    from paged_jax import program_store
    third = new()
    with mock.patch.object(program_store, "map_limit", lambda: 100), \
         mock.patch.object(program_store, "mapped_regions", lambda: 90):
      self.assertEqual(third.generate([prompt], sp)[0].outputs[0].token_ids, want)
    self.assertEqual(third.metrics()["evicted_programs"], 1)
    with self.assertRaisesRegex(ValueError, "program_store with a mesh"):
      Engine(PARAMS, CFG, program_store=store, mesh=object())

  def test_compiler_options_reach_every_step_program(self):
    # XLA options per engine (over XLA_FLAGS): here a dump folder, which XLA fills with each
    # step program it compiles (prefill and round). Same tokens; the store keeps them apart.
    import os
    import tempfile
    from paged_jax import program_store
    dump = tempfile.mkdtemp()
    cfg = config.tiny_config(num_layers=1)
    params = testing.random_params(cfg, seed=5, scale=0.3)
    e = Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=40), impl="xla",
               scheduler=SchedulerConfig(steps_per_sync=3, max_num_seqs=1),
               compiler_options={"xla_dump_to": dump})
    prompt = [5, 6, 7, 8, 9]
    got = e.generate([prompt], SamplingParams(max_tokens=5))[0].outputs[0].token_ids
    self.assertEqual(got, testing.DenseGreedy(params, cfg)(prompt, 5))
    dumped = {f.split(".")[1] for f in os.listdir(dump) if f.endswith("after_optimizations.txt")}
    self.assertEqual(dumped, {"jit_sample_step", "jit_multi_step_decode"})
    ident = lambda opts: program_store.engine_identity(cfg, "xla", e.params, e.pool, opts)
    self.assertNotEqual(ident({"xla_dump_to": dump}), ident(None))
    self.assertEqual(ident({}), ident(None))

  def test_an_edited_source_is_compiled_again_not_loaded(self):
    # The store's identity digests the source that traces the programs: after an edit (a
    # different digest) a new engine compiles afresh instead of loading the old programs.
    from unittest import mock
    from paged_jax import program_store
    store, new, _ = self._store_engines(2)
    prompt, sp = [5, 6, 7], SamplingParams(max_tokens=3)
    new().generate([prompt], sp)
    with mock.patch.object(program_store, "source_digest", lambda: "edited"):
      edited = new()
      edited.generate([prompt], sp)
    m = edited.metrics()
    self.assertEqual((m["programs_compiled"], m["programs_loaded"]), (2, 0))

  def test_source_digest_follows_source_files_only(self):
    import os
    import pathlib
    import tempfile
    from paged_jax import program_store
    with tempfile.TemporaryDirectory() as d:
      root = os.path.join(d, "pkg")
      os.makedirs(os.path.join(root, "sub"))
      write = lambda name, text: pathlib.Path(root, name).write_text(text)
      write("a.py", "x = 1\n")
      write("sub/k.cc", "int f();\n")
      digest = lambda: program_store.source_digest.__wrapped__((root,))
      before = digest()
      write("notes.md", "not source")
      self.assertEqual(digest(), before)
      for name, text in (("sub/k.cc", "int g();\n"), ("a.py", "x = 2\n")):
        write(name, text)
        self.assertNotEqual(digest(), before)
        before = digest()
    self.assertEqual(program_store.source_digest(), program_store.source_digest())
    self.assertRegex(program_store.source_digest(), "^[0-9a-f]{16}$")

  def test_programs_calling_the_cpu_kernel_store_and_load(self):
    # The decode programs hold the C++ kernel's custom call: stored, loaded back (the engine
    # registers the kernel before any load), they give the dense model's tokens.
    store, new, ref = self._store_engines(2, impl="cpu")
    prompt, sp = [4, 5, 6, 7, 8], SamplingParams(max_tokens=6)
    self.assertEqual(new().generate([prompt], sp)[0].outputs[0].token_ids, ref(prompt, 6))
    second = new()
    self.assertEqual(second.generate([prompt], sp)[0].outputs[0].token_ids, ref(prompt, 6))
    m = second.metrics()
    self.assertEqual((m["programs_compiled"], m["programs_loaded"]), (0, 2))

  def test_warmup_stores_and_loads_and_a_damaged_program_is_compiled_again(self):
    import os
    store, new, ref = self._store_engines(1)
    # one user, a 64-token budget: prefill buckets of 16, 32 and 64 tokens, a one-row round,
    # a one-row decode step
    self.assertEqual(new().warmup("one_user")["compiled"], 5)
    report = new().warmup("one_user")
    self.assertEqual((report["loaded"], report["compiled"]), (5, 0))
    for name in os.listdir(store):
      with open(os.path.join(store, name), "wb") as f:
        f.write(b"damaged")
    engine = new()
    prompt = [9, 8, 7, 6]
    with self.assertLogs(level="WARNING") as logs:
      out = engine.generate([prompt], SamplingParams(max_tokens=5))
    self.assertEqual(out[0].outputs[0].token_ids, ref(prompt, 5))
    self.assertIn("cannot load", logs.output[0])
    self.assertEqual(engine.metrics()["programs_compiled"], 2)

  def test_a_program_from_the_persistent_cache_is_not_stored(self):
    # XLA:CPU serializes an executable JAX's persistent cache supplied without its compiled
    # functions; the engine stores only what it compiled itself (a hit counted meanwhile:
    # simulated here, as the suite runs without that cache).
    import os
    import tempfile
    from paged_jax import program_store
    store = tempfile.mkdtemp()
    real = program_store.cache_hits
    calls = iter(range(100))
    program_store.cache_hits = lambda: next(calls)   # every compile "hits"
    self.addCleanup(setattr, program_store, "cache_hits", real)
    e = Engine(PARAMS, CFG, cache=CacheConfig(page_size=4, num_pages=40), impl="xla",
               program_store=store)
    e.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    self.assertEqual(e.metrics()["programs_compiled"], 2)
    self.assertEqual(os.listdir(store), [])


class StoppableRoundsTest(absltest.TestCase):
  """Rounds as chained one-step links (`Engine(stoppable_rounds=True)`) that `step(interrupt)`
  ends early: the same tokens as k-step scans, however the rounds are cut."""

  def make(self, **sched):
    return Engine(PARAMS, CFG, cache=CacheConfig(page_size=4, num_pages=80),
                  scheduler=SchedulerConfig(**sched), impl="xla", stoppable_rounds=True)

  def run_interrupted(self, e, prompts, params, interrupt, late=()):
    """Steps e with `interrupt` until done; `late` (prompt, params) arrive after step 3."""
    ids = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, steps = {}, 0
    while e.has_unfinished():
      for o in e.step(interrupt):
        if o.finished:
          final[o.request_id] = o.outputs[0].token_ids
      steps += 1
      if steps == 3:
        ids += [e.add_request(p, sp) for p, sp in late]
    return [final[i] for i in ids]

  def test_same_tokens_as_scan_rounds_however_cut(self):
    greedy = SamplingParams(max_tokens=11)
    seeded = [SamplingParams(max_tokens=9, temperature=1.0, top_k=20, seed=s) for s in range(3)]
    params = [greedy, seeded[0], greedy, seeded[1]]
    late = [(PROMPTS[4], seeded[2]), (PROMPTS[2], greedy)]
    scan = make(steps_per_sync=4)
    ref = self.run_interrupted(scan, PROMPTS[:4], params, None, late)
    rng = np.random.default_rng(0)
    for name, interrupt in [("never", None), ("sometimes", lambda: rng.random() < 0.4),
                            ("always", lambda: True)]:
      e = self.make(steps_per_sync=4)
      got = self.run_interrupted(e, PROMPTS[:4], params, interrupt, late)
      self.assertEqual(got, ref, name)
      self.assertEqual({k.kind for k in e.programs}, {"step", "link"})
      if name == "never":
        self.assertEqual(e.stats.rounds_stopped, 0)
        self.assertEqual(e.stats.decode_tokens, scan.stats.decode_tokens)
      else:
        self.assertGreater(e.stats.rounds_stopped, 0)
      finish(self, e)
    self.assertEqual([ref[0], ref[2], ref[5]], [dense(p, 11) for p in PROMPTS[:3:2] + [PROMPTS[2]]])
    self.assertNotIn("link", {k.kind for k in scan.programs})

  def test_interrupt_ends_the_round_after_the_links_dispatched(self):
    e = self.make(steps_per_sync=8)
    rid = e.add_request(PROMPTS[0], SamplingParams(max_tokens=20))
    self.assertLen(e.step()[0].outputs[0].new_token_ids, 1)   # the prompt's step
    asked = []
    def interrupt():   # False before link 1, True before link 2: links 0 and 1 run
      asked.append(True)
      return len(asked) == 2
    out = e.step(interrupt)
    self.assertLen(asked, 2)
    self.assertLen(out[0].outputs[0].new_token_ids, 2)
    self.assertEqual((e.stats.rounds_stopped, e.stats.decode_steps, e.stats.decode_tokens),
                     (1, 2, 2))
    e.bm.check_invariants()
    self.assertLen(e.step()[0].outputs[0].new_token_ids, 8)   # no interrupt: the whole round
    ignored = make(steps_per_sync=8)   # scan rounds cannot stop: interrupt is not asked
    ignored.add_request(PROMPTS[0], SamplingParams(max_tokens=20))
    ignored.step()
    self.assertLen(ignored.step(lambda: asked.append(False) or True)[0].outputs[0]
                   .new_token_ids, 8)
    self.assertLen(asked, 2)
    final = [o for o in e.stream() if o.finished][0].outputs[0].token_ids
    self.assertEqual(final, dense(PROMPTS[0], 20))
    self.assertEqual(e.scheduler.find(rid), None)
    finish(self, e)

  def test_links_ahead_orders_waits_and_dispatches(self):
    # `_chain` with a fake link: before link s it waits for link s - 1 - links_ahead, then asks.
    import types
    log = []
    class Tokens:
      def __init__(self, i):
        self.i = i
      def block_until_ready(self):
        log.append(("wait", self.i))
    def run(params, pool, state, sampling):
      log.append(("run", state))
      return types.SimpleNamespace(tokens=Tokens(state)), pool, state + 1, sampling
    for ahead, want in [
        (0, ["run 0", "wait 0", "ask", "run 1", "wait 1", "ask", "run 2", "wait 2", "ask",
             "run 3"]),
        (1, ["run 0", "ask", "run 1", "wait 0", "ask", "run 2", "wait 1", "ask", "run 3"]),
        (3, ["run 0", "ask", "run 1", "ask", "run 2", "ask", "run 3"])]:
      e = self.make(steps_per_sync=4)
      e.links_ahead = ahead
      log.clear()
      plan = types.SimpleNamespace(num_steps=4)
      outs = e._chain(run, (None, "pool", 0, None), plan,
                      lambda: log.append(("ask", None)) or False)
      self.assertEqual([f"{a} {b}" if b is not None else a for a, b in log], want, ahead)
      self.assertEqual((len(outs), plan.num_steps, e.pool), (4, 4, "pool"))
      log.clear()   # stopped before link 2: links 0 and 1 ran, the plan says so
      outs = e._chain(run, (None, "pool", 0, None), plan,
                      lambda: sum(a == "run" for a, _ in log) == 2)
      self.assertEqual((len(outs), plan.num_steps, e.stats.rounds_stopped), (2, 2, 1))

  def test_any_links_ahead_serves_the_same_tokens(self):
    params = [SamplingParams(max_tokens=9, temperature=1.0, top_k=20, seed=s) for s in range(3)]
    ref = self.run_interrupted(make(steps_per_sync=4), PROMPTS[:3], params, None)
    for ahead in (0, 2):
      rng = np.random.default_rng(ahead)
      e = Engine(PARAMS, CFG, cache=CacheConfig(page_size=4, num_pages=80),
                 scheduler=SchedulerConfig(steps_per_sync=4), impl="xla",
                 stoppable_rounds=True, links_ahead=ahead)
      self.assertEqual(self.run_interrupted(e, PROMPTS[:3], params,
                                            lambda: rng.random() < 0.4), ref, ahead)
      self.assertGreater(e.stats.rounds_stopped, 0)
    for bad in (-1, 1.5, True, "1"):
      with self.assertRaisesRegex(ValueError, f"links_ahead={bad!r}"):
        Engine(PARAMS, CFG, cache=CacheConfig(page_size=4, num_pages=80), impl="xla",
               stoppable_rounds=True, links_ahead=bad)

  def test_warmed_links_serve_without_a_compile(self):
    import jax
    events = []
    watching = [False]
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: events.append(name) if watching[0] else None)
    e = self.make(steps_per_sync=3, max_num_seqs=2, max_num_batched_tokens=64)
    keys = e.warmup_programs("one_user")
    self.assertNotIn("round", {k.kind for k in keys})
    self.assertTrue(all(k.num_steps == 1 for k in keys if k.kind == "link"))
    e.warmup("one_user")
    watching[0] = True
    rng = np.random.default_rng(1)
    out = self.run_interrupted(e, [PROMPTS[1]], [SamplingParams(max_tokens=10)],
                               lambda: rng.random() < 0.5)
    watching[0] = False
    self.assertEqual(out, [dense(PROMPTS[1], 10)])
    self.assertEqual(e.metrics()["programs_on_demand"], 0)
    self.assertEqual([n for n in events if "compile" in n or "trace" in n], [])


if __name__ == "__main__":
  absltest.main()
