"""Runs examples/lightning_plugin.py again and again in forked children, signalling some: one import of Lightning.

    python tests/_lightning_trials.py SPEC.json RESULT.json

SPEC: ``{"argv": [...], "trials": [{"signal": "KILL"|"TERM"|null, "after_steps": N | null, "after_s": S | null}]}``.
Each trial forks a child that runs the example's ``main()`` with ``argv`` plus ``--out <dir>/trial-I.json``
(importing torch and Lightning takes seconds on a loaded machine; a fork takes milliseconds). The parent reads
the child's ``step N`` lines and sends the signal once it printed ``after_steps`` of them, or ``after_s`` seconds
after the fork, whichever comes first; then waits for the child. RESULT lists, per trial, the exit status (a
negative number: killed by that signal), the steps printed, and what the example wrote with ``--out``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_plugin.py"


def load_example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("lightning_plugin_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_trial(example, argv: list[str], trial: dict, out: Path) -> dict:  # type: ignore[no-untyped-def]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the example, its stdout into the pipe
        os.close(read)
        os.dup2(write, 1)
        sys.argv = [str(EXAMPLE), *argv, "--out", str(out)]
        status = 0
        try:
            example.main()
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:
            print(f"error {type(exc).__name__}: {exc}", flush=True)
            status = 1
        sys.stdout.flush()
        os._exit(status)
    os.close(write)
    steps: list[int] = []
    errors: list[str] = []
    buffer = b""
    signalled = False
    started = time.monotonic()
    sig = getattr(signal, f"SIG{trial['signal']}") if trial.get("signal") else None
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while True:
            timeout = None
            if sig is not None and not signalled and trial.get("after_s") is not None:
                timeout = max(0.0, started + trial["after_s"] - time.monotonic())
            ready, _, _ = select.select([pipe], [], [], timeout)
            if not ready:  # the time is up
                os.kill(pid, sig)
                signalled = True
                continue
            chunk = pipe.read(65536)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                text = line.decode()
                if text.startswith("step "):
                    steps.append(int(text.split()[1]))
                elif text.startswith("error "):
                    errors.append(text)
            if sig is not None and not signalled and trial.get("after_steps") is not None \
                    and len(steps) >= trial["after_steps"]:
                os.kill(pid, sig)
                signalled = True
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    result = json.loads(out.read_text()) if out.exists() else None
    return {"status": code, "signalled": signalled, "steps": steps, "errors": errors, "out": result}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    results_path = Path(sys.argv[2])
    example = load_example()
    results = []
    for i, trial in enumerate(spec["trials"]):
        out = results_path.parent / f"trial-{i}.json"
        out.unlink(missing_ok=True)
        results.append(run_trial(example, spec["argv"], trial, out))
        results_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
