"""A tool that lives in a venv of its own (pip triton for the PTX check, vLLM's CPU build as a
peer): make sure it is there, building the venv on first use, or say why it cannot be."""

from __future__ import annotations

import os
import subprocess


def ensure(python: str, module: str, version: str, install: list[str],
           uninstall: tuple[str, ...] = ()) -> str | None:
  """None when `python` imports `module` at `version`; else builds its venv (the directory two
  levels above `python`), pip-installs `install`, uninstalls `uninstall`, and checks again.
  Returns why not (the failing command and the end of its output) when that fails."""
  check = [python, "-c",
           f"import sys, {module}; sys.exit({module}.__version__ != {version!r})"]
  if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
    return None
  venv = os.path.dirname(os.path.dirname(python))
  pip = os.path.join(venv, "bin", "pip")
  steps = [["python3", "-m", "venv", venv], [pip, "install", "-q", *install]]
  if uninstall:
    steps.append([pip, "uninstall", "-y", *uninstall])
  for step in steps:
    proc = subprocess.run(step, capture_output=True, text=True)
    if proc.returncode:
      return f"`{' '.join(step)}` failed: {(proc.stderr or proc.stdout).strip()[-300:]}"
  if subprocess.run(check, capture_output=True).returncode:
    return f"{python} still cannot import {module} {version}"
  return None
