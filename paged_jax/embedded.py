"""The embedded default model, shipped inside the package (no download): a tiny Llama trained by
`experiments/train_copy_model.py` to copy a letter string, saved in Hugging Face format."""

from __future__ import annotations

import os

from paged_jax import checkpoint

EMBEDDED_MODEL_DIR = os.path.join(os.path.dirname(__file__), "assets", "copy_model")
BOS, SEP, EOS = 1, 2, 3   # the copy task's special tokens (see experiments/train_copy_model.py)


def load_embedded(dtype: str = "float32"):
  """(params, cfg, tokenizer) of the embedded copy model."""
  if not os.path.exists(os.path.join(EMBEDDED_MODEL_DIR, "config.json")):
    raise FileNotFoundError(f"the embedded model is missing from {EMBEDDED_MODEL_DIR}; rebuild it "
                            f"with: python -m experiments.train_copy_model")
  return checkpoint.load_checkpoint(EMBEDDED_MODEL_DIR, dtype)
