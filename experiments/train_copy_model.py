"""Trains the embedded default model: a tiny Llama that copies a random letter string.

  python -m experiments.train_copy_model                         # writes paged_jax/assets/copy_model
  python -m experiments.train_copy_model --steps=200 --out=/tmp/m   # a quick look

Task: `<bos> x1 .. xn <sep>` -> `x1 .. xn <eos>`, n in [min_len, max_len], letters a-z. Copying
needs attention over the whole prompt (an induction head reading position i of the prompt), so a
paging bug shows up as wrong letters, not as slightly different noise. Training uses the same
`model.Decoder` over a dense cache (`model.DenseKV`, one row per sequence), optax AdamW with a
cosine schedule, and loss on the copied part only. The result is saved in Hugging Face Llama format
with a `tokenizers` word-level tokenizer, and loaded like any other checkpoint.
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from paged_jax import checkpoint, model
from paged_jax.config import ModelConfig

SPECIALS = ["<pad>", "<bos>", "<sep>", "<eos>"]
LETTERS = [chr(ord("a") + i) for i in range(26)]
PAD, BOS, SEP, EOS = range(4)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 2500
  batch_size: int = 64
  min_len: int = 4
  max_len: int = 32
  learning_rate: float = 3e-3
  seed: int = 0
  hidden_size: int = 64
  num_layers: int = 2


def model_config(cfg: TrainConfig) -> ModelConfig:
  return ModelConfig(vocab_size=32, hidden_size=cfg.hidden_size,
                     intermediate_size=2 * cfg.hidden_size, num_layers=cfg.num_layers,
                     num_q_heads=4, num_kv_heads=2, head_dim=cfg.hidden_size // 4,
                     max_position=128, tie_embeddings=False)


def make_tokenizer():
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors
  vocab = {t: i for i, t in enumerate(SPECIALS + LETTERS)}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
  # encode("h e l l o") frames the letters as the task's prompt: <bos> h e l l o <sep>.
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A <sep>", special_tokens=[("<bos>", BOS), ("<sep>", SEP)])
  return tok


def sample_batch(rng: np.random.Generator, cfg: TrainConfig, batch_size: int):
  """tokens i32[B, L], loss mask f32[B, L] (1 where the next token is part of the answer)."""
  length = 2 * cfg.max_len + 3
  tokens = np.full((batch_size, length), PAD, np.int32)
  mask = np.zeros((batch_size, length), np.float32)
  for b in range(batch_size):
    n = rng.integers(cfg.min_len, cfg.max_len + 1)
    s = rng.integers(len(SPECIALS), len(SPECIALS) + len(LETTERS), n)
    seq = np.concatenate([[BOS], s, [SEP], s, [EOS]])
    tokens[b, :len(seq)] = seq
    mask[b, n + 1:2 * n + 2] = 1   # predicting x1..xn and <eos> from <sep>..xn
  return tokens, mask


def prompts_and_answers(rng: np.random.Generator, cfg: TrainConfig, count: int):
  """Held-out prompts [<bos> x <sep>] and their answers [x <eos>]."""
  out = []
  for _ in range(count):
    n = int(rng.integers(cfg.min_len, cfg.max_len + 1))
    s = rng.integers(len(SPECIALS), len(SPECIALS) + len(LETTERS), n).tolist()
    out.append(([BOS] + s + [SEP], s + [EOS]))
  return out


def dense_logits(params, mcfg: ModelConfig, tokens):
  """Teacher-forced logits f32[B, L, vocab] for a padded batch, through model.Decoder."""
  batch, length = tokens.shape
  shape = (mcfg.num_layers, batch, length, mcfg.num_kv_heads, mcfg.head_dim)
  kv = model.DenseKV(jnp.zeros(shape, mcfg.dtype), jnp.zeros(shape, mcfg.dtype),
                     seq_ids=jnp.repeat(jnp.arange(batch, dtype=jnp.int32), length),
                     positions=jnp.tile(jnp.arange(length, dtype=jnp.int32), batch),
                     seq_lens=jnp.full((batch,), length, jnp.int32),
                     cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32) * length, max_q_len=length)
  logits, _ = model.Decoder(mcfg).apply({"params": params}, tokens.reshape(-1),
                                        jnp.tile(jnp.arange(length, dtype=jnp.int32), batch), kv)
  return logits.reshape(batch, length, -1)


def train(cfg: TrainConfig, log_every: int = 250):
  """Returns (params, model config, per-checkpoint losses)."""
  mcfg = model_config(cfg)
  params = model.init_params(mcfg, cfg.seed)
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, min(200, cfg.steps // 10),
                                                cfg.steps, cfg.learning_rate / 20)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  opt_state = opt.init(params)

  @jax.jit
  def train_step(params, opt_state, tokens, mask):
    def loss_fn(p):
      logits = dense_logits(p, mcfg, tokens[:, :-1])
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
      return jnp.sum(ce * mask[:, :-1]) / jnp.sum(mask[:, :-1])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(cfg.seed)
  losses = []
  for i in range(cfg.steps):
    tokens, mask = sample_batch(rng, cfg, cfg.batch_size)
    params, opt_state, loss = train_step(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask))
    if (i + 1) % log_every == 0 or i == cfg.steps - 1:
      losses.append((i + 1, float(loss)))
      print(f"step {i + 1:5d}  loss {float(loss):.4f}", flush=True)
  return params, mcfg, losses


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  cfg = TrainConfig(steps=_STEPS.value, seed=_SEED.value)
  t = time.perf_counter()
  params, mcfg, _ = train(cfg)
  print(f"trained in {time.perf_counter() - t:.0f} s")
  checkpoint.save_checkpoint(params, mcfg, _OUT.value, tokenizer=make_tokenizer(),
                             bos_token_id=BOS, eos_token_id=EOS)
  print(f"saved to {_OUT.value}; evaluate with: python -m experiments.copy_eval --model={_OUT.value}")


if __name__ == "__main__":
  # Flags exist only when run as a script (see experiments/attention_bench.py).
  _STEPS = flags.DEFINE_integer("steps", 2500, "Training steps.")
  _SEED = flags.DEFINE_integer("seed", 0, "Seed.")
  _OUT = flags.DEFINE_string("out", "paged_jax/assets/copy_model", "Output directory (HF format).")
  app.run(main)
