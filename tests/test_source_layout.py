"""The house rules of the source tree that no linter checks (issue 22): no module over 400 lines, so that each
stays one idea a reader can hold; the import layers themselves are lint-imports' (make test runs it first)."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "taskpoint"
MAX_LINES = 400


def test_no_module_is_over_400_lines() -> None:
    modules = sorted(SRC.rglob("*.py"))
    assert len(modules) > 50  # the tree was found
    lines = {str(p.relative_to(SRC)): len(p.read_text(encoding="utf-8").splitlines()) for p in modules}
    over = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along a seam): {over}"
