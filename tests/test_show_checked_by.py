"""``taskpoint show`` prints what each step of the corpus (tests/corpus/, every manifest version) is checked by: the
count, size, hash and digests of its pieces (a payload's object since manifest version 7, a state dict's file), its
one BLAKE3 (version 6, and the shards of sharded steps) or its sha256 (older versions, file-set manifests), and
never a digest it does not have (``sha256: -`` for a step checked by BLAKE3), in text and in JSON alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from taskpoint.cli import main
from test_stored_corpus import SAMPLES, _copy

#: The samples that are steps (the others are single checkpoints and a rank's uncommitted record).
STEPS = [sample for sample in SAMPLES if sample.split("/")[1].startswith("step_")]


def checked_by(record: dict[str, Any]) -> dict[str, Any]:
    """What the stored ``record`` (a step's manifest, or one shard of it) says its data is checked by: the pieces its
    record lists, else its BLAKE3, else its sha256; and the pieces its content lists (a state dict's file, its
    hash sha256 when unnamed)."""
    pieces = record if "pieces" in record else record.get("content", {})
    found: dict[str, Any] = {}
    if "pieces" in pieces:
        found = {"pieces": len(pieces["pieces"]), "piece_size": pieces["piece_size"],
                 "piece_hash": pieces.get("piece_hash", "sha256"), "piece_digests": pieces["pieces"]}
    if "pieces" not in record:
        found.update({"blake3": record["blake3"]} if record.get("blake3") else
                     {"sha256": record["sha256"]} if record.get("sha256") else {})
    return found


def shown(capsys: pytest.CaptureFixture[str], steps: Path, step: int, *json_flag: str) -> str:
    capsys.readouterr()
    assert main(["show", str(steps), "--step", str(step), *json_flag]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("sample", STEPS)
def test_show_prints_what_each_stored_step_is_checked_by(sample: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    steps = _copy(sample, tmp_path) / "steps"
    manifests = sorted(steps.glob("ckpt-*/taskpoint.json"))
    assert manifests
    for manifest in manifests:
        doc = json.loads(manifest.read_bytes())
        step, expected = int(manifest.parent.name.removeprefix("ckpt-")), checked_by(doc)
        view = json.loads(shown(capsys, steps, step, "--json"))
        assert {key: view[key] for key in expected} == expected, (sample, step)
        assert view["sha256"] == doc["sha256"]  # kept in JSON, null when the record has none
        if expected.get("piece_digests"):
            assert "blake3" not in view or view.get("blake3") is None
        stored_shards = doc.get("content", doc).get("shards", ())  # older manifests keep them at the top
        for shard, stored in zip(view.get("shards", ()), stored_shards, strict=True):
            want = checked_by(stored)
            assert {key: shard[key] for key in want} == want, (sample, step, shard)
        text = shown(capsys, steps, step)
        assert "\nsha256: -\n" not in text and "\nblake3: -\n" not in text
        for key, value in expected.items():
            if key == "piece_digests":
                assert "".join(f"  - piece {i}: {d}\n" for i, d in enumerate(value)) in text, text
            else:
                assert f"\n{key}: {value}\n" in text, (key, text)
