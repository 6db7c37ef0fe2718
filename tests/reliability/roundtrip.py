"""Round trips by property: Hypothesis builds odd trees; each must come back byte for byte.

A tree has names with spaces, unicode, control characters and punctuation, empty folders, a deep chain of
folders, symlinks to files and folders inside the tree (relative), file modes, empty files and now and then
a file of a few MiB. It is saved with ``Checkpoint.save_sync`` and loaded by another ``Checkpoint``;
``helpers.snapshot`` (kind, permission bits, sha256 or link target of every entry) must be equal.

Every generated example is a trial: a failing one is recorded with a description of the tree and
Hypothesis goes on (no shrinking), so the failure count says how many examples failed, not just the first.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import taskpoint

from ._common import Result, Servers, describe_exception, first_line, location_or_skip, remove_location, timed

ODD_NAMES = ["a b", " leading", "trailing ", "ünïcødé", "日本語", "emoji-😀", ".hidden", "-dash", "x" * 200,
             "semi;colon", "back\\slash", "quote'\"", "new\nline", "tab\tname", "%41%2F", "..a", "a..", "@{}",
             "CON", "nul.txt", "ß", "Å", "\u00c5", "A\u030a", "zero\u200bwidth", "right\u202eleft"]
FILE_MODES = [0o644, 0o600, 0o755, 0o700, 0o444, 0o640, 0o555, 0o664]
DIR_MODES = [0o755, 0o700, 0o750, 0o775]
BIG_SIZES = [None, None, None, (1 << 20) + 7, (3 << 20) + 1]


def _strategies() -> Any:
    from hypothesis import strategies as st

    plain = st.text(st.characters(exclude_characters="/\x00", exclude_categories=("Cs",)), min_size=1, max_size=24)
    name = st.one_of(plain, st.sampled_from(ODD_NAMES)).filter(
        lambda s: s not in (".", "..") and len(s.encode("utf-8")) <= 200)
    file = st.tuples(st.just("file"), st.one_of(st.just(0), st.integers(0, 2000), st.sampled_from([4096, 65539])),
                     st.integers(0, 2**32 - 1), st.sampled_from(FILE_MODES))
    empty_dir = st.tuples(st.just("dir"), st.just({}), st.sampled_from(DIR_MODES))

    def folder(children: Any) -> Any:
        return st.tuples(st.just("dir"), st.dictionaries(name, children, max_size=5), st.sampled_from(DIR_MODES))

    node = st.recursive(st.one_of(file, empty_dir), folder, max_leaves=18)
    tree = st.dictionaries(name, node, min_size=0, max_size=6)
    return st.fixed_dictionaries({
        "tree": tree,
        "deep": st.integers(0, 48),
        "big": st.sampled_from(BIG_SIZES),
        "links": st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), name), max_size=4),
    })


def build(root: Path, spec: dict[str, Any]) -> None:
    """Make the tree ``spec`` describes under ``root`` (which must not exist yet)."""
    root.mkdir(parents=True)
    dir_modes: list[tuple[Path, int]] = []

    def make(folder: Path, entries: dict[str, Any]) -> None:
        for entry_name, node in entries.items():
            path = folder / entry_name
            if node[0] == "file":
                _, size, seed, mode = node
                path.write_bytes(random.Random(seed).randbytes(size))
                os.chmod(path, mode)
            else:
                _, children, mode = node
                path.mkdir()
                make(path, children)
                dir_modes.append((path, mode))

    make(root, spec["tree"])
    if spec["deep"]:
        deep = root.joinpath(*(f"level {i}" for i in range(spec["deep"])))
        deep.mkdir(parents=True)
        (deep / "bottom.txt").write_text("the bottom")
    if spec["big"]:
        (root / "big file.bin").write_bytes(random.Random(spec["big"]).randbytes(spec["big"]))
    # Internal symlinks, relative, to files and folders that exist in the tree.
    entries = sorted(p for p in root.rglob("*") if not p.is_symlink())
    folders = [root, *(p for p in entries if p.is_dir())]
    for i, j, link_name in spec["links"]:
        if not entries:
            break
        target, where = entries[i % len(entries)], folders[j % len(folders)]
        link = where / f"link {link_name}"
        if link.exists() or link.is_symlink():
            continue
        os.symlink(os.path.relpath(target, where), link)
    for path, mode in sorted(dir_modes, key=lambda item: -len(item[0].parts)):
        os.chmod(path, mode)


def describe(spec: dict[str, Any]) -> str:
    def names(entries: dict[str, Any]) -> list[Any]:
        out: list[Any] = []
        for key, node in entries.items():
            out.append(key if node[0] == "file" else {key: names(node[1])})
        return out

    return first_line(f"tree {names(spec['tree'])!r}, deep {spec['deep']}, big {spec['big']}, "
                      f"links {[n for _, _, n in spec['links']]!r}", 500)


def _remove(path: Path) -> None:
    for folder, dirs, _ in os.walk(path):
        for d in dirs:
            p = Path(folder, d)
            if not p.is_symlink():
                os.chmod(p, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def run_store(servers: Servers, kind: str, examples: int, seed: int, scratch: Path) -> Result:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from helpers import snapshot

    result = Result("Round trips by property (Hypothesis trees)", kind)
    with timed(result):
        location = location_or_skip(servers, kind, scratch, result)
        if location is None:
            return result
        counter = iter(range(10**9))
        features = {"links": 0, "big": 0, "deep>=20": 0, "empty files": 0}
        causes = {"a name with a backslash": 0, "a name whose 2nd character is ':'": 0, "neither": 0}

        @hypothesis_seed(seed)
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(_strategies())
        def example(spec: dict[str, Any]) -> None:
            n = next(counter)
            work = scratch / f"roundtrip-{kind}-{n}"
            src = work / "src"
            error = None
            names: list[str] = [str(spec)]
            try:
                build(src, spec)
                names = [p.name for p in src.rglob("*")]
                dest = location.url(f"example-{n % 3}")
                taskpoint.Checkpoint(dest, storage_options=location.storage_options).save_sync(src)
                with taskpoint.Checkpoint(dest, dest, storage_options=location.storage_options,
                                          workspace=work / "loaded") as cp:
                    loaded = cp.load_sync()
                    if loaded is None:
                        error = "load returned None"
                    else:
                        want, got = snapshot(src), snapshot(loaded)
                        if want != got:
                            missing = sorted(set(want) - set(got))[:3]
                            extra = sorted(set(got) - set(want))[:3]
                            changed = sorted(k for k in set(want) & set(got) if want[k] != got[k])[:3]
                            error = (f"differs: missing {missing!r}, extra {extra!r}, changed "
                                     f"{[(k, want[k], got[k]) for k in changed]!r}")
                snap = snapshot(src)
                features["links"] += any(v[0] == "link" for v in snap.values())
                features["big"] += bool(spec["big"])
                features["deep>=20"] += spec["deep"] >= 20
                features["empty files"] += any(v[0] == "file" and os.path.getsize(src / k) == 0
                                               for k, v in snap.items())
            except Exception as exc:
                error = describe_exception(exc)
            finally:
                _remove(work)
            if error is not None:  # which odd names the failing tree had, to tell the causes apart in the notes
                cause = ("a name with a backslash" if any("\\" in n for n in names) else
                         "a name whose 2nd character is ':'" if any(n[1:2] == ":" for n in names) else "neither")
                causes[cause] += 1
            result.trial(None if error is None else f"{error} — {describe(spec)}")

        example()
        result.note(f"{result.trials} trees: {', '.join(f'{v} with {k}' for k, v in features.items())}")
        if result.failures:
            result.note("failing trees had " + ", ".join(f"{k}: {v}" for k, v in causes.items()))
        remove_location(location)
    return result


def run(servers: Servers, counts: dict[str, int], seed: int, scratch: Path) -> list[Result]:
    results = []
    for kind, examples in counts.items():
        if examples > 0:
            results.append(run_store(servers, kind, examples, seed, scratch))
            r = results[-1]
            print(f"  {r.scenario} [{kind}]: {r.trials} trials, {r.failures} failures ({r.seconds:.0f} s)", flush=True)
    return results
