"""What quantized KV pages buy and cost on a real model, per format, side by side in one run.

  python -m experiments.kv_quant_bench                       # SmolLM2-135M-Instruct, f32
  python -m experiments.kv_quant_bench --formats=auto,int8:token --num_prompts=8

Formats are `kv_dtype[:kv_scales]` (`paged_jax.kv_quant`; "auto" is the model dtype, the
baseline). For each one:

  capacity   tokens a fixed KV budget holds (`CacheConfig.resolve_num_pages` x page_size, the
             scales counted), against the baseline's;
  error      attention outputs on the model's own activations: an eager dense forward over
             chat prompts records every layer's queries and (rotated) keys and values; the K/V
             are paged, stored in the format (`kv_quant.quantize_pages`) and attended through
             the XLA paged path, against the same path on unquantized pages: relative error
             (||o - o_ref|| / ||o_ref||, mean over layers) and max abs error. The same on unit
             normal q / K / V of the same shapes ("random");
  greedy     --num_prompts chat prompts, --max_tokens new tokens each (EOS ignored, so every
             answer has them all) through the engine with the pool in the format and the
             --budget_tokens budget (the baseline's pool holds that many tokens: a batch
             bound by memory, which preempts); against the baseline's answers: identical
             answers, and the mean share of each answer before its first difference;
             throughput (generated tokens / wall seconds of a warm pass), preemptions;
  perplexity exp(mean NLL) of the model on --text (public-domain prose shipped in
             tests/fixtures), prefilled in --ppl_chunk-token chunks of one sequence through a
             pool in the format, so every chunk after the first reads the earlier ones back
             from quantized pages.

One JSON line per run to --out, a figure (capacity and accuracy per format) to --plot.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROSE = os.path.join(ROOT, "tests", "fixtures", "public_domain_prose.txt")
FORMATS = ("auto", "int8:token", "int8:page", "float8_e4m3fn:tensor", "float8_e4m3fn:page",
           "float8_e5m2:tensor")
MORE_QUESTIONS = [
    "What is the capital of Japan?", "Name two animals that live in the ocean.",
    "What is 15 plus 27?", "Write one sentence about autumn.", "What do bees make?",
    "How many continents are there?", "What color do you get by mixing blue and yellow?",
    "Who was the first person to walk on the Moon?", "What is the longest river in Africa?",
    "Give an example of a renewable energy source.", "What is the main ingredient of bread?",
    "How many minutes are in an hour?", "What instrument has 88 keys?",
    "Name a bird that cannot fly.", "What is the hardest natural substance?",
    "Write a two-line poem about rain.", "What is the currency of the United Kingdom?",
    "What organ pumps blood through the body?",
]


def parse_formats(spec) -> list[str]:
  """"auto,int8:token" -> ["auto", "int8:token"], each checked (ValueError names a bad one)."""
  names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
  for name in names:
    cache_kw(name)
  if "auto" not in names:
    names = ["auto"] + names   # the baseline every figure is against
  return names


def cache_kw(name: str) -> dict:
  """CacheConfig keywords of a format name."""
  from paged_jax import kv_quant
  dtype, _, scales = name.partition(":")
  kv_quant.kv_format(dtype, scales or None)   # raises, naming the bad value
  return dict(kv_dtype=dtype, kv_scales=scales or None)


def prompts_for(params, cfg, tok, model_path, questions) -> list[list[int]]:
  """Chat prompts through the checkpoint's template, or the questions tokenized without one."""
  from paged_jax import chat, checkpoint
  try:
    conversation = chat.Chat(model_path, tok, checkpoint.load_eos_token_ids(model_path))
    return [conversation.prompt_ids([{"role": "user", "content": q}]) for q in questions]
  except Exception:   # noqa: BLE001 - no template: the plain text
    return [tok.encode(q).ids for q in questions]


def record_activations(params, cfg, prompts) -> list[tuple]:
  """Per layer (q [T, H, D], k [T, K, D], v, seq_lens, cu_q_lens) of an eager dense forward
  over `prompts` as one ragged batch (k rotated, as the pool stores it)."""
  import flax.struct
  import jax.numpy as jnp
  from paged_jax import model
  records = []

  @flax.struct.dataclass
  class RecordingKV(model.DenseKV):
    def attend(self, layer, q, k, v, **kw):
      records.append((layer, q, k, v))
      return model.DenseKV.attend(self, layer, q, k, v, **kw)

  lens = [len(p) for p in prompts]
  n, longest = sum(lens), max(lens)
  seq_ids = np.repeat(np.arange(len(prompts)), lens)
  positions = np.concatenate([np.arange(m) for m in lens])
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  shape = (cfg.num_layers, len(prompts), longest, cfg.num_kv_heads, cfg.head_dim)
  kv = RecordingKV(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype),
                   jnp.asarray(seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32),
                   jnp.asarray(lens, jnp.int32), jnp.asarray(cu), max_q_len=longest)
  tokens = jnp.asarray(np.concatenate(prompts), jnp.int32)
  model.Decoder(cfg).apply({"params": params}, tokens, jnp.asarray(positions, jnp.int32), kv)
  return [(q, k, v, np.asarray(lens, np.int32), cu, seq_ids, positions)
          for _, q, k, v in sorted(records, key=lambda r: r[0])]


def attention_errors(records, names, page_size: int, seed: int = 0) -> dict:
  """{name: {"real": {rel, max_abs}, "random": {...}}}: see the module docstring."""
  import jax.numpy as jnp
  from paged_jax import attention, kv_quant, testing
  from paged_jax.config import CacheConfig
  rng = np.random.default_rng(seed)
  out = {name: {"real": [], "random": []} for name in names}
  for q, k, v, lens, cu, seq_ids, positions in records:
    for kind in ("real", "random"):
      if kind == "random":
        q, k, v = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
      dense_k = np.zeros((len(lens), int(lens.max())) + k.shape[1:], np.float32)
      dense_v = np.zeros_like(dense_k)
      dense_k[seq_ids, positions] = np.asarray(k, np.float32)
      dense_v[seq_ids, positions] = np.asarray(v, np.float32)
      kp, vp, tables = testing.paged_from_dense(dense_k, dense_v, lens, page_size, poison=False)
      kp, vp = jnp.asarray(kp), jnp.asarray(vp)
      args = (jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(cu, jnp.int32))
      qf = jnp.asarray(q, jnp.float32)
      ref = np.asarray(attention.paged_attention(qf, kp, vp, *args, max_q_len=int(lens.max()),
                                                 impl="xla"))
      for name in names:
        fmt = CacheConfig(**cache_kw(name)).kv_format
        if fmt is None:
          got = ref
        else:
          got = np.asarray(attention.paged_attention(
              qf, kv_quant.quantize_pages(kp, fmt), kv_quant.quantize_pages(vp, fmt), *args,
              max_q_len=int(lens.max()), impl="xla"))
        out[name][kind].append((float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                                float(np.abs(got - ref).max())))
  return {name: {kind: dict(rel=float(np.mean([r for r, _ in rows])),
                            max_abs=float(np.max([m for _, m in rows])))
                 for kind, rows in kinds.items()} for name, kinds in out.items()}


def perplexity(params, cfg, ids, name: str, page_size: int, chunk: int) -> dict:
  """exp(mean NLL) of ids[1:] given the earlier ones, prefilled `chunk` tokens at a time."""
  import jax
  import jax.numpy as jnp
  from paged_jax import step
  from paged_jax.config import CacheConfig
  from paged_jax.state import AttentionMetadata, KVPool
  fmt = CacheConfig(**cache_kw(name)).kv_format
  usable = min(len(ids), cfg.max_position) // chunk * chunk
  ids = np.asarray(ids[:usable], np.int32)
  num_pages = 1 + -(-usable // page_size)
  pool = KVPool.create(num_layers=cfg.num_layers, num_pages=num_pages, page_size=page_size,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                       kv_format=fmt)
  table = np.arange(1, num_pages, dtype=np.int32)[None]
  nll = []
  for c0 in range(0, usable, chunk):
    pos = np.arange(c0, c0 + chunk, dtype=np.int32)
    md = AttentionMetadata(jnp.asarray(table), jnp.asarray([c0 + chunk], jnp.int32),
                           jnp.asarray([0, chunk], jnp.int32),
                           jnp.asarray((table[0][pos // page_size]) * page_size + pos % page_size),
                           max_q_len=chunk)
    batch = step.Batch(jnp.asarray(ids[c0:c0 + chunk]), jnp.asarray(pos), md,
                       jnp.arange(chunk, dtype=jnp.int32))
    logits, pool = step.prefill_step(params, pool, batch, cfg=cfg, impl="xla")
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    nxt = ids[c0 + 1:c0 + chunk + 1]
    nll.extend(-logp[np.arange(len(nxt)), nxt])
  return dict(perplexity=float(math.exp(np.mean(nll))), ppl_tokens=len(nll))


def greedy_run(params, cfg, tok, eos, prompts, name: str, *, max_tokens: int, page_size: int,
               budget_bytes: int, warmup: bool, scan_layers: bool = True) -> dict:
  """The prompts through an engine whose pool takes `budget_bytes` in this format."""
  from paged_jax.config import CacheConfig
  from paged_jax.engine import Engine
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  cache = CacheConfig(page_size=page_size, memory_bytes=budget_bytes, **cache_kw(name))
  sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

  def once():
    engine = Engine(params, cfg, cache=cache, impl="xla", tokenizer=tok, eos_token_ids=eos,
                    scan_layers=scan_layers, scheduler=SchedulerConfig(max_num_seqs=len(prompts),
                                              max_num_batched_tokens=2048, steps_per_sync=8))
    start = time.perf_counter()
    outs = engine.generate(prompts, sp)
    return time.perf_counter() - start, outs, engine
  if warmup:
    once()
  seconds, outs, engine = once()
  tokens = [o.outputs[0].token_ids for o in outs]
  generated = sum(map(len, tokens))
  return dict(capacity_tokens=engine.capacity_tokens, num_pages=engine.num_pages,
              pool_bytes=int(engine.pool.nbytes), seconds=seconds, generated=generated,
              tokens_per_s=generated / seconds, preemptions=engine.stats.preemptions,
              tokens=tokens)


def run(model: str | None = None, *, formats=FORMATS, num_prompts: int = 50,
        max_tokens: int = 64, page_size: int = 16, budget_tokens: int = 1024,
        text: str = PROSE, ppl_chunk: int = 256, error_prompts: int = 4, warmup: bool = True,
        dtype: str = "float32", scan_layers: bool = True, loaded=None, progress=print) -> dict:
  """Every format on one model; see the module docstring. `loaded`: (params, cfg, tokenizer,
  eos ids) instead of loading `model`."""
  from experiments import dtype_bench
  from paged_jax import checkpoint
  from paged_jax.config import CacheConfig
  names = parse_formats(formats)
  if loaded is None:
    params, cfg, tok = checkpoint.load_checkpoint(model, dtype)
    eos = checkpoint.load_eos_token_ids(model)
  else:
    params, cfg, tok, eos = loaded
  questions = (list(dtype_bench.QUESTIONS) + MORE_QUESTIONS)[:num_prompts]
  prompts = prompts_for(params, cfg, tok, model, questions)
  budget_bytes = (budget_tokens // page_size + 1) * CacheConfig(page_size=page_size
                                                                ).bytes_per_page(cfg)
  with open(text) as f:
    text_ids = tok.encode(f.read()).ids
  errors = attention_errors(record_activations(params, cfg, prompts[:error_prompts]), names,
                            page_size)
  rows = {}
  for name in names:
    row = greedy_run(params, cfg, tok, eos, prompts, name, max_tokens=max_tokens,
                     page_size=page_size, budget_bytes=budget_bytes, warmup=warmup,
                     scan_layers=scan_layers)
    row.update(perplexity(params, cfg, text_ids, name, page_size, ppl_chunk))
    row["attention_error"] = errors[name]
    rows[name] = row
    progress(f"  {name:22s} {row['capacity_tokens']:6d} tokens, {row['tokens_per_s']:6.1f} "
             f"tok/s, ppl {row['perplexity']:.3f}, attention rel error (real) "
             f"{errors[name]['real']['rel']:.2e}")
  base = rows["auto"]
  for name, row in rows.items():
    row["capacity_ratio"] = row["capacity_tokens"] / base["capacity_tokens"]
    row["throughput_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
    row["agreement"] = dtype_bench.compare(base["tokens"], row["tokens"])
  return dict(model=model or "(given)", dtype=cfg.dtype, num_prompts=len(prompts),
              max_tokens=max_tokens, page_size=page_size, budget_tokens=budget_tokens,
              budget_bytes=int(budget_bytes), text=os.path.basename(text),
              ppl_chunk=ppl_chunk, warm=warmup, formats=rows)


def format_result(r: dict) -> str:
  lines = [f"kv_quant bench [{os.path.basename(r['model'])}, {r['dtype']}]: budget "
           f"{r['budget_bytes'] / 2**20:.1f} MiB ({r['budget_tokens']} {r['dtype']} tokens), "
           f"{r['num_prompts']} chat prompts x {r['max_tokens']} greedy tokens, perplexity on "
           f"{r['text']}" + ("" if r.get("warm", True) else
                              "; tok/s of a cold pass (its compiles included: --nowarmup)"),
           "| format | tokens in budget | x | tok/s | x | preemptions | identical | "
           "share before 1st diff | perplexity | attn rel err real / random | max abs (real) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, v in r["formats"].items():
    e, a = v["attention_error"], v["agreement"]
    lines.append(f"| {name} | {v['capacity_tokens']} | {v['capacity_ratio']:.2f} | "
                 f"{v['tokens_per_s']:.1f} | {v['throughput_ratio']:.2f} | {v['preemptions']} | "
                 f"{a['identical']}/{a['of']} | {100 * a['mean_prefix_share']:.0f}% | "
                 f"{v['perplexity']:.3f} | {e['real']['rel']:.1e} / {e['random']['rel']:.1e} | "
                 f"{e['real']['max_abs']:.1e} |")
  return "\n".join(lines)


def plot(r: dict, path: str) -> str:
  from experiments import output
  plt = output.pyplot()
  names = list(r["formats"])
  rows = [r["formats"][n] for n in names]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  x = np.arange(len(names))
  axes[0].bar(x, [v["capacity_ratio"] for v in rows], color="tab:blue", label="tokens in budget")
  axes[0].bar(x + 0.0, [v["throughput_ratio"] for v in rows], width=0.35, color="tab:orange",
              label="tok/s")
  axes[0].set_title(f"vs {r['dtype']} pages, same {r['budget_bytes'] / 2**20:.1f} MiB")
  axes[0].legend(fontsize=8)
  axes[1].bar(x, [100 * v["agreement"]["mean_prefix_share"] for v in rows], color="tab:green")
  axes[1].set_title(f"greedy: % of {r['max_tokens']} tokens before the 1st difference")
  axes[2].bar(x, [v["perplexity"] for v in rows], color="tab:red")
  lo = min(v["perplexity"] for v in rows)
  axes[2].set_ylim(lo * 0.98, max(v["perplexity"] for v in rows) * 1.01)
  axes[2].set_title(f"perplexity on {r['text']}")
  for ax in axes:
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
  return output.save_figure(fig, path)


def main(argv):
  from absl import flags
  from experiments import dtype_bench, output
  f = flags.FLAGS
  model = dtype_bench.require_model(f.model)
  r = run(model, formats=f.formats, num_prompts=f.num_prompts, max_tokens=f.max_tokens,
          page_size=f.page_size, budget_tokens=f.budget_tokens, text=f.text,
          ppl_chunk=f.ppl_chunk, error_prompts=f.error_prompts, warmup=f.warmup, dtype=f.dtype,
          scan_layers=f.scan_layers)
  print(format_result(r))
  for v in r["formats"].values():
    v.pop("tokens")   # the answers are compared above; the line keeps the figures
  if f.plot:
    r["png"] = plot(r, f.plot)
  output.append_jsonl(r, f.out)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("model", None, "Checkpoint directory or GGUF (default: SmolLM2-135M).")
  flags.DEFINE_string("formats", ",".join(FORMATS), "kv_dtype[:kv_scales] per format.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "The model's dtype.")
  flags.DEFINE_integer("num_prompts", 50, "Chat prompts (at most 50).")
  flags.DEFINE_integer("max_tokens", 64, "Greedy tokens per answer (EOS ignored).")
  flags.DEFINE_integer("page_size", 16, "Tokens per page.")
  flags.DEFINE_integer("budget_tokens", 1024, "The KV budget, as tokens of the model dtype.")
  flags.DEFINE_string("text", PROSE, "Text for the perplexity.")
  flags.DEFINE_integer("ppl_chunk", 256, "Tokens per prefill chunk of the perplexity.")
  flags.DEFINE_integer("error_prompts", 4, "Prompts whose activations the error is taken on.")
  flags.DEFINE_bool("warmup", True, "Time a second, warm pass of the greedy run.")
  flags.DEFINE_bool("scan_layers", True, "The engine's layers as a lax.scan (each new batch "
                    "shape compiles in ~1-2 s instead of ~10 s for SmolLM2's 30 layers).")
  flags.DEFINE_string("out", os.path.join(ROOT, "experiments", "results", "kv_quant.jsonl"),
                      "JSONL to append to ('' for none).")
  flags.DEFINE_string("plot", os.path.join(ROOT, "experiments", "results", "kv_quant.png"),
                      "Figure path ('' for none).")
  app.run(main)
