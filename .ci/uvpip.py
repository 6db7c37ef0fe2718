"""``uv pip install`` with this machine's pip configuration: the Makefile's installs, in seconds rather than minutes.

uv resolves and installs the test stack (torch, JAX, Lightning, transformers) about ten times faster than pip, but it
does not read pip's configuration. What pip is configured with here (``pip config list``: pip.conf files and
``PIP_*`` variables) is handed to uv: index URLs, find-links, constraints and the certificate bundle. Without any,
uv uses PyPI, as pip would.

Usage: ``python .ci/uvpip.py UV PYTHON ARGS...``: UV is the uv binary, PYTHON the venv's interpreter (which runs
``pip config list``; it needs pip), ARGS what follows ``uv pip install``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

#: pip's options that take lists, and the uv flag of each.
_LISTS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
          "constraint": "--constraint"}


def pip_settings(python: str) -> dict[str, list[str]]:
    """pip's configured values by option name (``global.find-links`` and ``:env:.find-links`` are one option)."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    settings: dict[str, list[str]] = {}
    for line in listed.stdout.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        values = settings.setdefault(key.rpartition(".")[2], [])
        for word in str(ast.literal_eval(value)).split():
            if word not in values:
                values.append(word)
    return settings


def main(uv: str, python: str, *args: str) -> None:
    settings = pip_settings(python)
    flags = ["--index-strategy", "unsafe-best-match"]  # pip takes the best version over every index; uv the first
    # Compile to bytecode as pip does: uv does not by default, and where PYTHONDONTWRITEBYTECODE is set (as here)
    # every process would compile torch, Lightning and JAX again at each import (a third more CPU in make test).
    flags.append("--compile-bytecode")
    for option, flag in _LISTS.items():
        for value in settings.get(option, []):
            flags += [flag, value]
    env = dict(os.environ)
    if settings.get("cert"):
        env.setdefault("SSL_CERT_FILE", settings["cert"][0])
    os.execvpe(uv, [uv, "pip", "install", "--python", python, *flags, *args], env)


if __name__ == "__main__":
    main(*sys.argv[1:])
