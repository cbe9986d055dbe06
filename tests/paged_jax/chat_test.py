"""Chat templates (paged_jax.chat) and the serve command's --chat / --stream / "messages" lines.

The serve checks run on a copy of the embedded copy model given a chat template of its own
(`<bos>` + the user's letters + `<sep>`: the prompt the copy model answers), so the whole path
(template -> ids -> engine -> stop at EOS -> streamed text) runs in a second. transformers'
rendering of real templates is compared in smollm2_test (slow tier).
"""

import contextlib
import io
import json
import os
import shutil
import tempfile

from absl.testing import absltest

from paged_jax import chat, checkpoint, embedded, serve

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
COPY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] != 'user' %}"
                 "{{ raise_exception('only user turns') }}{% endif %}{{ m['content'] }}"
                 "{% endfor %}{% if add_generation_prompt %}<sep>{% endif %}")


class RenderTest(absltest.TestCase):

  def test_chatml(self):
    text = chat.render(CHATML, [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"}])
    self.assertEqual(text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
                           "<|im_end|>\n<|im_start|>assistant\n")
    self.assertFalse(chat.render(CHATML, [{"role": "user", "content": "Hi"}],
                                 add_generation_prompt=False).endswith("assistant\n"))

  def test_trim_and_lstrip_blocks_as_transformers(self):
    template = "{% for m in messages %}\n    {{ m['content'] }}\n{% endfor %}"
    self.assertEqual(chat.render(template, [{"role": "user", "content": "a"},
                                            {"role": "user", "content": "b"}]), "    a\n    b\n")

  def test_errors_name_the_source_and_the_entry(self):
    with self.assertRaisesRegex(chat.ChatTemplateError,
                                r"model.gguf: the chat template fails to render: "
                                r"TemplateError: only user turns"):
      chat.render(COPY_TEMPLATE, [{"role": "assistant", "content": "x"}], source="model.gguf")
    with self.assertRaisesRegex(chat.ChatTemplateError, r"x.gguf: .*TemplateSyntaxError"):
      chat.render("{% for %}", [{"role": "user", "content": "x"}], source="x.gguf")
    with self.assertRaisesRegex(ValueError, r"messages\[1\]=.*needs 'role' and 'content'"):
      chat.render(CHATML, [{"role": "user", "content": "a"}, {"content": "b"}])
    with self.assertRaisesRegex(ValueError, r"messages\[0\]: role='robot' is not one of"):
      chat.render(CHATML, [{"role": "robot", "content": "a"}])
    with self.assertRaisesRegex(ValueError, r"messages must be a non-empty list"):
      chat.render(CHATML, [])

  def test_where_templates_are_found(self):
    d = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, d)
    self.assertIsNone(chat.load_template(d))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
      json.dump({"chat_template": [{"name": "tool_use", "template": "T"},
                                   {"name": "default", "template": "D"}]}, f)
    self.assertEqual(chat.load_template(d), "D")
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
      f.write("J")
    self.assertEqual(chat.load_template(d), "J")   # the .jinja file wins, as in transformers


class ServeChatTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.dir = tempfile.mkdtemp()
    shutil.copytree(embedded.EMBEDDED_MODEL_DIR, cls.dir, dirs_exist_ok=True)
    with open(os.path.join(cls.dir, "tokenizer_config.json"), "w") as f:
      json.dump({"chat_template": COPY_TEMPLATE}, f)
    # The copy model's tokenizer adds <bos> / <sep> in its post-processor; a template writes
    # them as text, so they must be special tokens (as chat models' tokenizers have them).
    tok = checkpoint.load_tokenizer(cls.dir)
    tok.add_special_tokens(["<bos>", "<sep>", "<eos>"])
    tok.save(os.path.join(cls.dir, "tokenizer.json"))
    cls.model = serve.load_model(serve.ServeConfig(model_dir=cls.dir))

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.dir)
    super().tearDownClass()

  def _run(self, **kw):
    cfg = serve.ServeConfig(model_dir=self.dir, page_size=4, num_pages=64, progress=False, **kw)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      r = serve.run(cfg, self.model)
    return r, out.getvalue()

  def test_chat_prompts_go_through_the_template_and_stream(self):
    r, printed = self._run(prompts=("h e l l o",), chat=True, stream=True)
    self.assertEqual(r["completions"][0]["text"], " h e l l o")   # after <sep>'s context
    self.assertEqual(r["completions"][0]["finish_reason"], "stop")   # at <eos>, the end of turn
    self.assertEqual(printed, " h e l l o\n")   # the streamed pieces, then a newline
    # the prompt was the template's: <bos> letters <sep> (7 tokens), not the plain encoding
    self.assertEqual(r["input_tokens"], 7)

  def test_messages_lines_and_their_errors(self):
    path = os.path.join(self.dir, "requests.jsonl")
    with open(path, "w") as f:
      f.write(json.dumps({"messages": [{"role": "user", "content": "p a g e"}]}) + "\n")
      f.write(json.dumps({"messages": [{"role": "user", "content": "k v"}], "n": 2,
                          "temperature": 0.0}) + "\n")
    r, printed = self._run(prompts_file=path, stream=True)
    self.assertEqual([c["text"] for c in r["completions"]], [" p a g e", " k v", " k v"])
    self.assertIn("[0] ", printed)   # several requests: chunks tagged with their index
    with open(path, "a") as f:
      f.write(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with self.assertRaisesRegex(chat.ChatTemplateError, r"fails to render.*only user turns"):
      self._run(prompts_file=path)
    with open(path, "w") as f:
      f.write(json.dumps({"messages": "hello"}) + "\n")
    with self.assertRaisesRegex(ValueError, r"requests.jsonl:1: messages must be a non-empty"):
      self._run(prompts_file=path)

  def test_a_checkpoint_without_a_template_is_refused(self):
    with self.assertRaisesRegex(chat.ChatTemplateError, r"copy_model: the checkpoint has no "
                                                        r"chat template"):
      serve.run(serve.ServeConfig(prompts=("a",), chat=True, progress=False),
                serve.load_model(serve.ServeConfig()))


if __name__ == "__main__":
  absltest.main()
