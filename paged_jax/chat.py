"""Chat templates: a checkpoint's Jinja template rendered with jinja2, as transformers renders it
(`apply_chat_template`: a sandboxed environment, trim_blocks and lstrip_blocks, `raise_exception`,
`tojson`, `strftime_now`), with no transformers at run time. Host side.

Where the template lives: a GGUF file's `tokenizer.chat_template`; a Hugging Face directory's
`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates: "default" is taken). The end-of-turn tokens a chat stops at are the
checkpoint's EOS ids plus the template's own end-of-turn marker where the tokenizer knows it.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

from paged_jax.checkpoint import CheckpointError

# Markers templates close a turn with (ChatML, Llama 3, Gemma, Phi-3, ...).
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eom_id|>",
                       "<|endoftext|>")
ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(CheckpointError):
  """A chat template is missing or fails to render; the message names the file."""


def load_template(path: str) -> str | None:
  """The checkpoint's chat template source, or None if it has none."""
  if os.path.isfile(path):   # a GGUF file
    from paged_jax import gguf_file
    return gguf_file.metadata(path)["chat_template"]
  jinja = os.path.join(path, "chat_template.jinja")
  if os.path.exists(jinja):
    with open(jinja) as f:
      return f.read()
  config = os.path.join(path, "tokenizer_config.json")
  if not os.path.exists(config):
    return None
  try:
    with open(config) as f:
      template = json.load(f).get("chat_template")
  except (OSError, json.JSONDecodeError) as e:
    raise ChatTemplateError(f"{config}: cannot read it ({e})") from None
  if isinstance(template, list):   # [{"name": ..., "template": ...}, ...]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  return template


def _raise(message):
  from jinja2.exceptions import TemplateError
  raise TemplateError(message)


def _environment():
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
      x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
  env.globals["raise_exception"] = _raise
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def check_messages(messages: Any, where: str = "messages") -> list[dict]:
  """Raises ValueError naming the bad entry unless messages is a list of {role, content}."""
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} objects, "
                     f"got {messages!r:.80}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      raise ValueError(f"{where}[{i}]={m!r:.80} needs 'role' and 'content'")
    if m["role"] not in ROLES:
      raise ValueError(f"{where}[{i}]: role={m['role']!r} is not one of {ROLES}")
  return messages


def render(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
           source: str = "the chat template", **special) -> str:
  """The prompt text of a conversation.

  Args:
    messages: [{"role": ..., "content": ...}, ...].
    special: bos_token, eos_token, ... as the template expects them.
    source: the file the template came from, named in errors.
  """
  from jinja2.exceptions import TemplateError
  check_messages(list(messages))
  try:
    compiled = _environment().from_string(template)
    return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                           **special)
  except TemplateError as e:
    raise ChatTemplateError(f"{source}: the chat template fails to render: "
                            f"{type(e).__name__}: {e}") from None


class Chat:
  """A checkpoint's template with its tokenizer: messages -> prompt ids, and the ids that end a
  turn."""

  def __init__(self, path: str, tokenizer, eos_token_ids: Sequence[int] = ()):
    self.path = path
    self.template = load_template(path)
    if self.template is None:
      raise ChatTemplateError(f"{path}: the checkpoint has no chat template")
    if tokenizer is None:
      raise ChatTemplateError(f"{path}: a chat needs the checkpoint's tokenizer; it has none")
    self.tokenizer = tokenizer
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    markers = [m for m in END_OF_TURN_MARKERS if m in self.template and m in vocab]
    self.end_of_turn_ids = tuple(dict.fromkeys([*eos_token_ids, *(vocab[m] for m in markers)]))
    id_to_token = {i: t for t, i in vocab.items()}
    self.special = {}
    meta = _special_ids(path)
    for name, token_id in meta.items():
      if token_id is not None and token_id in id_to_token:
        self.special[name] = id_to_token[token_id]

  def prompt_text(self, messages: Sequence[dict]) -> str:
    return render(self.template, messages, source=self.path, **self.special)

  def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
    """The rendered prompt's ids; the template writes its own special tokens (no BOS added)."""
    return self.tokenizer.encode(self.prompt_text(messages), add_special_tokens=False).ids


def _special_ids(path: str) -> dict[str, int | None]:
  """bos_token / eos_token ids of a checkpoint (GGUF metadata, or config.json)."""
  if os.path.isfile(path):
    from paged_jax import gguf_file
    meta = gguf_file.metadata(path)
    eos = meta["eos_token_ids"]
    return {"bos_token": meta["bos_token_id"], "eos_token": eos[0] if eos else None}
  config = os.path.join(path, "config.json")
  try:
    with open(config) as f:
      hf = json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}
  eos = hf.get("eos_token_id")
  return {"bos_token": hf.get("bos_token_id"),
          "eos_token": eos[0] if isinstance(eos, list) and eos else eos}
