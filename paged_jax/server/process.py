"""The server in a subprocess, for tests and benchmarks: start it on a free loopback port, read
its URL from the line it prints once listening, stop it with SIGTERM.

  with ServerProcess(["--num_pages=64"]) as server:
    client = openai.OpenAI(base_url=server.url, api_key="unused")
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

_READY = re.compile(r"paged_jax\.server: serving (\S+) on (http://\S+)")


class ServerProcess:
  """`python -m paged_jax.server --port=0 *args` in a subprocess.

  Args:
    args: flags for the server (--host / --port are set here).
    python: the interpreter.
    start_timeout: seconds to wait for the ready line (loading a model and, with --warmup,
      compiling happen before it).
    env: extra environment variables.

  Attributes (once started): url (".../v1"), base ("http://host:port"), model (its id),
  proc (the Popen), output (what it printed: stdout and stderr).
  """

  def __init__(self, args=(), *, python: str = sys.executable, start_timeout: float = 300.0,
               env: dict | None = None):
    self.args, self.python, self.start_timeout = list(args), python, start_timeout
    self.env = {**os.environ, **(env or {})}
    self.proc = None
    self.url = self.base = self.model = None
    self._lines: list[str] = []
    self._reader = None

  def start(self) -> "ServerProcess":
    cmd = [self.python, "-m", "paged_jax.server", "--host=127.0.0.1", "--port=0", *self.args]
    self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=self.env)
    # One thread reads every line from the start (a full pipe would block the server) and
    # says when the ready line came or the output ended. (Waiting on the pipe with select and
    # then reading lines from its buffered reader hung when the ready line arrived in one read
    # with the line before it: the line sat in the reader's buffer, the pipe stayed empty.)
    self._ready = None   # the ready line's match, once printed
    self._seen = threading.Event()   # set at the ready line or at the end of the output
    self._reader = threading.Thread(target=self._drain, daemon=True)
    self._reader.start()
    if not self._seen.wait(self.start_timeout):
      self._fail(cmd, "did not start in time")
    if self._ready is None:   # the end of its output: it exited
      self._fail(cmd, "exited")
    self.model, self.url = self._ready.group(1), self._ready.group(2)
    self.base = self.url[:-len("/v1")]
    return self

  def _drain(self) -> None:
    for line in self.proc.stdout:
      self._lines.append(line)
      if self._ready is None:
        self._ready = _READY.search(line)
        if self._ready is not None:
          self._seen.set()
    self._seen.set()

  def _fail(self, cmd, why: str):
    self.stop()
    raise RuntimeError(f"the server {why} (`{' '.join(cmd)}`):\n{self.output[-3000:]}")

  @property
  def output(self) -> str:
    """What it printed so far (stdout and stderr)."""
    return "".join(self._lines)

  def stop(self, timeout: float = 60.0) -> int:
    """SIGTERM, then waits (SIGKILL after `timeout`); returns the exit code."""
    if self.proc is None:
      return 0
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    try:
      self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    if self._reader is not None:
      self._reader.join(timeout=10)
    else:
      self._lines.extend(self.proc.stdout.readlines())
    return self.proc.returncode

  def __enter__(self) -> "ServerProcess":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
