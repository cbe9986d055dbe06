"""`ServerProcess`'s start: reading the ready line whatever the pipe delivers with it.

A fake interpreter (a shell script standing in for `python`, given the server's command line)
prints what a server would, so these run in milliseconds without starting one.
"""

import os
import shutil
import stat
import tempfile
import time

from absl.testing import absltest

from paged_jax.server.process import ServerProcess

READY = "paged_jax.server: serving fake-model on http://127.0.0.1:4242/v1"


class ServerProcessTest(absltest.TestCase):

  def fake_python(self, body: str) -> str:
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp)
    path = os.path.join(tmp, "python")
    with open(path, "w") as f:
      f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path

  def test_the_ready_line_in_one_write_with_the_lines_before_it(self):
    # The log line and the ready line reach the pipe in one write, then the server stays
    # quiet, as an idle server does (start used to wait on the pipe for more and time out).
    python = self.fake_python(f"printf 'I1207 engine.py] a log line\\n{READY}\\n'; exec sleep 60")
    server = ServerProcess(python=python, start_timeout=20)
    t = time.monotonic()
    try:
      server.start()
      self.assertLess(time.monotonic() - t, 10)
      self.assertEqual((server.model, server.url, server.base),
                       ("fake-model", "http://127.0.0.1:4242/v1", "http://127.0.0.1:4242"))
      self.assertIn("a log line", server.output)
    finally:
      server.stop(timeout=10)

  def test_an_exit_before_the_ready_line_is_reported_with_its_output(self):
    python = self.fake_python("echo 'no model at that path' >&2; exit 3")
    with self.assertRaisesRegex(RuntimeError, "(?s)the server exited.*no model at that path"):
      ServerProcess(python=python, start_timeout=20).start()

  def test_no_ready_line_in_time(self):
    python = self.fake_python("echo 'compiling...'; exec sleep 60")
    server = ServerProcess(python=python, start_timeout=1)
    with self.assertRaisesRegex(RuntimeError, "(?s)did not start in time.*compiling"):
      server.start()
    self.assertIsNotNone(server.proc.poll())   # stopped on the way out


if __name__ == "__main__":
  absltest.main()
