"""Summaries of py-spy's raw (collapsed-stack) profiles: ``python -m benchmarks._profiles FILE...``.

For each thread: its share of the samples, the functions where it spends its own time (the leaf frame)
and the functions it spends time under (inclusive), taskpoint's own frames first. ``--idle`` profiles
include waiting, which is what shows where a pipeline stalls.
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_THREAD = re.compile(r"^thread \((?P<id>[^)]*)\): (?P<name>.*)$")


def _strip_line(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (file.py:123)``."""
    m = re.match(r"^(.*) \((.*?)(\d*)\)$", frame)
    if not m:
        return frame
    where = m.group(2).rsplit("/", 1)[-1]
    return f"{m.group(1)} ({where}{m.group(3)})"


def summarize(path: Path, top: int = 12) -> str:
    per_thread: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    for raw in path.read_text().splitlines():
        m = _LINE.match(raw)
        if not m:
            continue
        frames = m.group("stack").split(";")
        count = int(m.group("count"))
        thread = frames[0]
        t = _THREAD.match(thread)
        name = t.group("name") if t else thread
        name = re.sub(r"\(.*\)$", "", name).strip() or name
        body = [_strip_line(f) for f in frames[1:]]
        totals[name] += count
        per_thread[name][body[-1] if body else "(idle or native)"] += count
        for f in set(body):
            inclusive[name][f] += count
    grand = sum(totals.values()) or 1
    out = [f"{path.name}: {grand} samples"]
    for name, n in totals.most_common():
        out.append(f"\n== thread {name}: {n} samples ({100 * n / grand:.0f}% of all)")
        out.append("  self (leaf frame):")
        for f, c in per_thread[name].most_common(top):
            out.append(f"    {100 * c / n:5.1f}%  {f}")
        out.append("  inclusive, taskpoint frames:")
        for f, c in [(f, c) for f, c in inclusive[name].most_common() if "taskpoint" in f or "_archive" in f
                     or "_codecs" in f or "_storage" in f or "_transfer" in f or "_payloads" in f][:top]:
            out.append(f"    {100 * c / n:5.1f}%  {f}")
    return "\n".join(out)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))
