"""The OpenAI request schemas and stop strings, without a server."""

from absl.testing import absltest
import pydantic

from paged_jax.server import protocol


class StopStringsTest(absltest.TestCase):

  def test_cuts_at_the_first_stop_and_holds_back_a_possible_start(self):
    s = protocol.StopStrings(("END", "\n\n"))
    self.assertEqual(s.update("abc"), ("abc", False))
    self.assertEqual(s.update("abc E"), ("abc ", False))      # "E" may become "END"
    self.assertEqual(s.update("abc EN"), ("abc ", False))
    self.assertEqual(s.update("abc ENx"), ("abc ENx", False))  # it did not
    self.assertEqual(s.update("abc\n"), ("abc", False))
    self.assertEqual(s.update("abc\n\nmore END"), ("abc", True))
    self.assertEqual(s.update("xENDy\n\n"), ("x", True))

  def test_no_stops_passes_everything(self):
    self.assertEqual(protocol.StopStrings(()).update("a\n\n"), ("a\n\n", False))


class RequestTest(absltest.TestCase):

  def test_prompt_forms(self):
    def prompts(p):
      return protocol.CompletionRequest(prompt=p).prompts()
    self.assertEqual(prompts("hi"), ["hi"])
    self.assertEqual(prompts([1, 2]), [[1, 2]])
    self.assertEqual(prompts(["a", "b"]), ["a", "b"])
    self.assertEqual(prompts([[1], [2, 3]]), [[1], [2, 3]])
    with self.assertRaisesRegex(protocol.ProtocolError, "prompt is empty"):
      prompts([])

  def test_wrong_types_are_refused_by_name(self):
    for body, field in [({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
                        ({"prompt": "a", "temperature": "hot"}, "temperature"),
                        ({"prompt": "a", "n": 1.5}, "n"),
                        ({"prompt": "a", "top_p": 0}, "top_p"),
                        ({"prompt": {"x": 1}}, "prompt")]:
      with self.assertRaises(pydantic.ValidationError) as e:
        protocol.CompletionRequest.model_validate(body)
      self.assertIn(field, str(e.exception))

  def test_unsupported_knobs_are_refused_and_noops_accepted(self):
    protocol.CompletionRequest(prompt="a", presence_penalty=0.0, best_of=1).check_supported()
    with self.assertRaisesRegex(protocol.ProtocolError, "presence_penalty=0.5"):
      protocol.CompletionRequest(prompt="a", presence_penalty=0.5).check_supported()
    with self.assertRaisesRegex(protocol.ProtocolError, "best_of=3"):
      protocol.CompletionRequest(prompt="a", best_of=3).check_supported()

  def test_sampling_params(self):
    req = protocol.CompletionRequest(prompt="a", temperature=0.5, top_k=-1, n=2, seed=7,
                                     stop_token_ids=[4], ignore_eos=True)
    sp = req.sampling_params(9, 3, extra_stop_ids=(5, 4))
    self.assertEqual((sp.max_tokens, sp.temperature, sp.top_k, sp.n, sp.seed, sp.logprobs),
                     (9, 0.5, 0, 2, 7, 3))
    self.assertEqual((sp.stop_token_ids, sp.ignore_eos), ((4, 5), True))

  def test_chat_content_parts_and_logprobs(self):
    req = protocol.ChatCompletionRequest(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        logprobs=True, top_logprobs=2)
    self.assertEqual(req.rendered_messages(), [{"role": "user", "content": "ab"}])
    self.assertEqual(req.num_logprobs, 2)
    with self.assertRaisesRegex(protocol.ProtocolError, "top_logprobs needs logprobs"):
      _ = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "a"}],
                                         top_logprobs=2).num_logprobs
    with self.assertRaisesRegex(protocol.ProtocolError, "only text parts"):
      protocol.ChatCompletionRequest(messages=[{"role": "user", "content": [
          {"type": "image_url", "image_url": {}}]}]).rendered_messages()


if __name__ == "__main__":
  absltest.main()
