"""The documentation runs: every python block of docs/ and README.md is executed, the CLI examples name real
commands and options, the install commands are ones that work today, the API reference covers every public
name, and the site builds with mkdocs --strict.

Blocks of one page run in order in one namespace (as a reader runs them), in a process of their own (forked from
one that imported torch, Lightning or transformers when the page uses them: tests/_zygote.py) whose working
directory is a temp folder, with TASKPOINT_ROOT at ``.taskpoint`` inside it (the default root, made explicit).
Markers, an HTML comment on the line(s) right before a block:

- ``<!-- not-run: why -->``: the block is not run (it needs what a test machine lacks); the reason is required.
- ``<!-- needs: s3 -->`` (or ``gcs``, ``azure``, several separated by commas): the page's process gets fsspec
  configuration (``FSSPEC_S3`` and the like) pointing at the test server, whose bucket ``my-bucket`` exists.
- ``<!-- shell: runs -->`` before a ``bash`` block: after the page's python blocks, each of its commands runs
  in the same folder (with the venv's ``taskpoint`` on PATH) and must exit 0.

A block whose only content is ``--8<-- "examples/x.py"`` shows an example that tests/test_examples*.py run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click
import fsspec
import pytest

import _zygote as zygote

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
DOC_BUCKET = "my-bucket"
MAX_NOT_RUN = 7  # such blocks should stay rare: raise this only with a reason in the block's marker

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not-run|needs|shell)\s*:\s*(?P<value>.*?)\s*-->\s*$")
_INCLUDE = re.compile(r'^\s*--8<--\s+"(?P<path>[^":]+)(?::[\w:-]+)?"\s*$')  # "path", "path:section"
_PROTOCOL_OF = {"s3": "s3", "gcs": "gs", "azure": "az"}
_SERVER_FIXTURE = {"s3": "s3_server", "gcs": "gcs_server", "azure": "azure_server"}


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    not_run: str | None = None
    needs: set[str] = field(default_factory=set)
    shell_runs: bool = False

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def include(self) -> str | None:
        lines = [line for line in self.code.splitlines() if line.strip()]
        match = _INCLUDE.match(lines[0]) if len(lines) == 1 else None
        return match["path"] if match else None


def parse_blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].startswith(indent) and lines[j].strip().startswith(fence)
                                      and not lines[j].strip()[len(fence):].strip()):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        assert j < len(lines), f"{page.relative_to(REPO)}:{i + 1}: code block never closed"
        block = Block(page, i + 1, opening["lang"].lower(), "\n".join(body) + "\n")
        k = i - 1
        while k >= 0 and (marker := _MARKER.match(lines[k])):
            if marker["kind"] == "not-run":
                block.not_run = marker["value"]
            elif marker["kind"] == "shell":
                assert marker["value"] == "runs", f"{page.relative_to(REPO)}:{k + 1}: only 'shell: runs' is known"
                block.shell_runs = True
            else:
                block.needs |= {v.strip() for v in marker["value"].split(",") if v.strip()}
            k -= 1
        blocks.append(block)
        i = j + 1
    return blocks


PAGES = [*sorted(DOCS.rglob("*.md")), REPO / "README.md"]
BLOCKS = [block for page in PAGES for block in parse_blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang in ("python", "py")]
SHELL = [b for b in BLOCKS if b.shell_runs]
RUN_PAGES = sorted({b.page for b in PYTHON if b.not_run is None and b.include is None} | {b.page for b in SHELL})


#: The script that runs one page's blocks (in one namespace, each compiled under its markdown location).
RUNNER = REPO / "tests" / "_docs_page.py"
#: What a page's process imports ahead, by the first of these its blocks import: a page that uses a framework is
#: forked from a server that imported it (tests/_zygote.py: torch's import alone is 1.5 CPU-s, transformers' 2.7),
#: any other page runs in a fresh process.
PRELOADS = [("transformers", zygote.TRANSFORMERS), ("lightning", zygote.LIGHTNING), ("torch", zygote.TORCH)]


def _preload(blocks: list[Block]) -> tuple[str, ...] | None:
    code = "".join(b.code for b in blocks)
    return next((modules for name, modules in PRELOADS
                 if re.search(rf"^\s*(?:import|from)\s+{re.escape(name)}\b", code, re.M)), None)


def _store_environment(request: pytest.FixtureRequest, needs: set[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for kind in sorted(needs):
        assert kind in _SERVER_FIXTURE, f"unknown store {kind!r} in a needs: marker (known: {sorted(_SERVER_FIXTURE)})"
        server = request.getfixturevalue(_SERVER_FIXTURE[kind])
        options = server.storage_options
        fs = fsspec.filesystem(_PROTOCOL_OF[kind], skip_instance_cache=True, **options)
        if not fs.exists(DOC_BUCKET):
            fs.mkdir(DOC_BUCKET)
        env[f"FSSPEC_{_PROTOCOL_OF[kind].upper()}"] = json.dumps(options)
    return env


def _page_id(page: Path) -> str:
    return str(page.relative_to(DOCS if DOCS in page.parents else REPO))


@pytest.mark.parametrize("page", RUN_PAGES, ids=[_page_id(p) for p in RUN_PAGES])
def test_python_blocks_of_the_page_run(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    blocks = [b for b in PYTHON if b.page == page and b.not_run is None and b.include is None]
    needs = set().union(*(b.needs for b in blocks))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKPOINT_", "FSSPEC_"))}
    env.update(_store_environment(request, needs))
    work = tmp_path / "work"
    work.mkdir()
    env["TASKPOINT_ROOT"] = str(work / ".taskpoint")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    listed = tmp_path / "blocks.json"
    listed.write_text(json.dumps([{"where": b.where, "code": b.code} for b in blocks]), encoding="utf-8")
    argv, preload = [str(RUNNER), str(listed)], _preload(blocks)
    out = (subprocess.run([sys.executable, *argv], cwd=work, env=env, capture_output=True, text=True, timeout=240)
           if preload is None else zygote.run(preload, argv, env, cwd=work, timeout=240))
    assert out.returncode == 0, f"{page.relative_to(REPO)}: a block failed\n{out.stdout}\n{out.stderr}"
    for block in (b for b in SHELL if b.page == page):
        for n, line in enumerate(block.code.splitlines(), start=block.line + 1):
            if line.strip() and not line.lstrip().startswith("#"):
                ran = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True,
                                     timeout=120)
                assert ran.returncode == 0, f"{block.page.relative_to(REPO)}:{n}: {line}\n{ran.stdout}{ran.stderr}"


def test_every_python_block_is_run_included_or_says_why_not() -> None:
    not_run = [b for b in PYTHON if b.not_run is not None]
    assert all(b.not_run.strip() for b in not_run), [b.where for b in not_run if not b.not_run.strip()]
    assert len(not_run) <= MAX_NOT_RUN, [f"{b.where}: {b.not_run}" for b in not_run]
    assert len(RUN_PAGES) >= 10  # the parser found the pages' blocks
    assert REPO / "README.md" in RUN_PAGES  # issue 27: its "In a retried task" block raised NameError
    for block in BLOCKS:
        assert not (block.needs and block.lang not in ("python", "py")), f"{block.where}: needs: on a non-python block"
        assert not (block.shell_runs and block.lang not in ("bash", "sh")), f"{block.where}: shell: on another block"


def test_included_examples_exist_and_tests_run_them() -> None:
    tests_text = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").rglob("test_*.py"))
    included = [b for b in BLOCKS if b.include]
    assert included, "no page includes an example"
    for block in included:
        path = REPO / block.include
        assert path.is_file(), f"{block.where}: {block.include} does not exist"
        assert path.name in tests_text, f"{block.where}: no test runs {block.include}"


# -- the command line --------------------------------------------------------------------------------------

#: How a shell block types the command: plain, or by its path in the venv of ``make demo`` (issue 27).
_COMMAND = re.compile(r"^(?:\.venv/bin/)?taskpoint ")


def _command_lines() -> list[tuple[str, str]]:
    """Each `taskpoint ...` (or `.venv/bin/taskpoint ...`) command of the shell blocks, with where it is."""
    found = []
    for block in BLOCKS:
        if block.lang not in ("sh", "bash", "console", "shell"):
            continue
        for n, raw in enumerate(block.code.splitlines(), start=block.line + 1):
            line = raw.strip()
            if block.lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            for part in re.split(r"\|\||&&|;|\|", line.split(" #")[0]):
                part = part.strip()
                if _COMMAND.match(part):
                    found.append((f"{block.page.relative_to(REPO)}:{n}", part))
    return found


def _check_arguments(command: click.Command, args: list[str], where: str) -> None:
    options = {name: p for p in command.params if isinstance(p, click.Option) for name in p.opts + p.secondary_opts}
    positional = [p for p in command.params if isinstance(p, click.Argument)]
    given: list[str] = []
    rest = iter(args)
    for token in rest:
        if token == "--":
            given.extend(rest)
            break
        if token.startswith("-") and token != "-":
            name = token.split("=", 1)[0]
            assert name in options, f"{where}: {command.name} has no option {name}"
            option = options[name]
            if not (option.is_flag or option.count) and "=" not in token:
                next(rest)
            continue
        given.append(token)
    if any(p.nargs == -1 for p in positional):
        return
    assert len(given) == len(positional), f"{where}: {command.name} takes {len(positional)} argument(s), got {given}"


def test_cli_examples_name_real_commands_and_options() -> None:
    from taskpoint.cli import cli

    lines = _command_lines()
    assert len(lines) >= 10
    group_options = {name for p in cli.params for name in p.opts + p.secondary_opts}
    for where, line in lines:
        args = shlex.split(line)[1:]
        while args and args[0].startswith("-"):
            assert args[0] in group_options, f"{where}: taskpoint has no global option {args[0]}"
            args.pop(0)
        if not args:
            continue
        command = cli.commands.get(args[0])
        assert command is not None, f"{where}: taskpoint has no command {args[0]!r}"
        _check_arguments(command, args[1:], where)


# -- installing --------------------------------------------------------------------------------------------

#: ``pip install`` of the published package (``"taskpoint[s3]"``, ``taskpoint``): not on PyPI yet.
_PYPI_FORM = re.compile(r"""pip install\s+(?:-U\s+)?["']?taskpoint(?:\[|["'\s`]|$)""")
#: ``pip install -e ".[s3]"`` run in the user's project installs the user's project, not taskpoint.
_DOT_FORM = re.compile(r"""pip install\s+(?:-e\s+)?["']?\.(?:\[|["'\s`]|$)""")
_PUBLISHED = "once taskpoint is published"


def test_install_commands_work_today_and_the_pypi_form_says_it_waits_for_publishing() -> None:
    """Issue 27: every guide said `pip install "taskpoint[s3]"` (No matching distribution found), and
    getting-started's `pip install -e ".[s3]"` installed the reader's own project."""
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            where = f"{page.relative_to(REPO)}:{n}"
            assert not _DOT_FORM.search(line), f"{where}: installs the current folder, not taskpoint: {line}"
            assert not _PYPI_FORM.search(line) or _PUBLISHED in line, f"{where}: say '{_PUBLISHED}': {line}"
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(encoding="utf-8"), re.M)[1]
    for page in (REPO / "README.md", DOCS / "getting-started.md"):
        text = page.read_text(encoding="utf-8")
        for works in ('pip install -e "path/to/taskpoint[s3]"', "make -C path/to/taskpoint dist",
                      f'pip install "path/to/taskpoint/dist/taskpoint-{version}-py3-none-any.whl[s3]"',
                      f'`pip install "taskpoint[s3]"` is the form for {_PUBLISHED} on PyPI'):
            assert works in text, f"{page.relative_to(REPO)} does not say {works}"


def test_the_pages_say_how_to_type_the_command_make_demo_installed() -> None:
    """Issue 27: `taskpoint ls ...` after `make demo` was `command not found`: the venv is not active."""
    for page in (REPO / "README.md", DOCS / "getting-started.md"):
        text = page.read_text(encoding="utf-8")
        assert ".venv/bin/taskpoint ls" in text and "source .venv/bin/activate" in text, page.name


# -- the API reference and the site ------------------------------------------------------------------------

def test_api_reference_names_every_public_name() -> None:
    import taskpoint

    reference = "\n".join(p.read_text(encoding="utf-8") for p in (DOCS / "api").glob("*.md"))
    documented = set(re.findall(r"^::: taskpoint(?:\.\w+)*\.(\w+)\s*$", reference, re.M))
    assert set(taskpoint.__all__) - documented == set()
    for extra in ("jax", "torch", "lightning", "transformers"):
        page = (DOCS / "api" / f"{extra}.md").read_text(encoding="utf-8")
        names = re.search(r"__all__ = \[(.*?)\]", (REPO / f"src/taskpoint/{extra}/__init__.py").read_text()).group(1)
        for name in re.findall(r'"(\w+)"', names):
            assert re.search(rf"^::: taskpoint\.{extra}\.{name}\s*$", page, re.M), f"taskpoint.{extra}.{name}: missing"


def test_site_builds_strictly_with_the_docstrings(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    checkpoint_page = (site / "api" / "checkpoint.html").read_text(encoding="utf-8")
    assert "where the previous attempt saved" in checkpoint_page  # Checkpoint's docstring, rendered
    assert ":meth:" not in checkpoint_page  # Sphinx roles are tidied by docs/_hooks.py
    jax_page = (site / "api" / "jax.html").read_text(encoding="utf-8")
    assert "OrbaxCheckpointHandler" in jax_page and "load_pytree_sync" in jax_page
    assert (site / "performance.html").read_text(encoding="utf-8").count("performance.png") >= 1
    # Search from file:// (the offline plugin): the index as a script, the Worker shim from the site itself.
    home = (site / "index.html").read_text(encoding="utf-8")
    assert (site / "search" / "search_index.js").is_file()
    assert 'src="javascripts/iframe-worker-shim.js"' in home and "unpkg.com" not in home
    _assert_no_raw_roles_or_page_paths(site)
    # A role with a title is a link to what it names (issue 40: "CheckpointManager.save <taskpoint....save>").
    torch_page = (site / "api" / "torch.html").read_text(encoding="utf-8")
    assert re.search(r'<a [^>]*href="manager\.html#taskpoint\.CheckpointManager\.save"[^>]*><code>'
                     r"CheckpointManager\.save</code></a>", torch_page)
    # Long lines of code wrap with a hanging indent, not to column 0: every line is a span the stylesheet indents.
    assert '<span id="__span-0-1">' in (site / "getting-started.html").read_text(encoding="utf-8")
    css = (DOCS / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert re.search(r'pre > code > span\[id\^="__span-"\] \{[^}]*display: block;[^}]*text-indent: -4ch;', css)


#: What Markdown leaves of a Sphinx role or of a page named as a path, in the text of a built page.
_RAW_ROLE = re.compile(r":(?:meth|class|func|attr|exc|data|mod|obj):|&lt;~?taskpoint\.")
_RAW_PAGE_PATH = re.compile(r"(?<![\w/.-])docs/[\w/-]+\.md")


def _assert_no_raw_roles_or_page_paths(site: Path) -> None:
    """No page of the built site shows a Sphinx role or a ``docs/....md`` path as text (outside code blocks and
    links); each page link docs/_hooks.py makes of such a path leads to a page of the site."""
    found = []
    for page in site.rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        text = re.sub(r"<(pre|script|a)\b.*?</\1>", "", html, flags=re.DOTALL)
        found += [f"{page.relative_to(site)}: {m.group(0)}" for m in (*_RAW_ROLE.finditer(text),
                                                                      *_RAW_PAGE_PATH.finditer(text))]
        for href in re.findall(r'<a href="([^"#:]+\.html)(?:#[\w-]*)?">[\w/-]+\.md', html):
            assert (page.parent / href).resolve().is_file(), f"{page.relative_to(site)}: {href}"
    assert not found, "\n".join(found)


def test_the_pages_name_every_extra_and_what_a_new_user_needs_beside_it() -> None:
    """Issue 40: getting-started lists every extra; the API index names the extras' modules and KeepBest; the
    guides say what goes beside flyte, that s3:// needs [s3] beside [transformers], where StateDict is, and that
    moto[server] beside [s3] fails in pip's resolver."""
    started = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    extras = re.search(r"^Extras: (.*?)\. The core", started, re.M | re.DOTALL)[1]
    declared = re.findall(r"^(\w+) = \[", (REPO / "pyproject.toml").read_text(encoding="utf-8").split(
        "[project.optional-dependencies]")[1].split("\n[")[0], re.M)
    for extra in set(declared) - {"docs", "test", "bench", "dev"}:
        assert f"`{extra}`" in extras, extra
    assert "installing-beside-flyte" in started and "TASKPOINT_RUN_NAME" in started
    index = (DOCS / "api" / "index.md").read_text(encoding="utf-8")
    for name in ("taskpoint.torch", "taskpoint.lightning", "taskpoint.transformers", "[taskpoint.KeepBest]",
                 "[taskpoint.checkpoints_in]", "(torch.md)", "(lightning.md)", "(transformers.md)"):
        assert name in index, name
    assert "### Installing beside flyte" in (DOCS / "guides" / "platforms.md").read_text(encoding="utf-8")
    assert "`taskpoint[transformers,s3]`" in (DOCS / "guides" / "transformers.md").read_text(encoding="utf-8")
    assert "[`StateDict`][taskpoint.torch.StateDict]" in (DOCS / "guides" / "pytorch.md").read_text(encoding="utf-8")
    storage = (DOCS / "guides" / "storage.md").read_text(encoding="utf-8")
    assert 'pip install "moto[server]"' in storage and "fails in" in storage and "[test]" in storage


def test_user_pages_speak_no_tracker_vocabulary() -> None:
    """The pages are for users: no issue or item numbers of the project's tracker, no PASS/FAIL of its targets."""
    tracker = re.compile(r"\b[Ii]ssues? \d|\b[Ii]tems? \d|\b(?:PASS|FAIL)\b|#\d{2,}\b")
    pages = [*DOCS.rglob("*.md"), REPO / "README.md"]
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in pages
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if tracker.search(line)]
    assert not found, "\n".join(found)
