"""Benchmark results name the command that produced them."""

from __future__ import annotations

import json
import sys

from benchmarks.output import save_result


def test_a_result_starts_with_its_command(tmp_path, monkeypatch):
    monkeypatch.setattr(
        sys,
        "argv",
        ["/repo/benchmarks/quality.py", "--instances", "12", "--methods", "am;am:x=1"],
    )
    out = save_result({"summary": {"right": 3}}, tmp_path / "r" / "q.json")
    written = json.loads(out.read_text())
    assert list(written) == ["command", "summary"]
    assert (
        written["command"]
        == "python -m benchmarks.quality --instances 12 --methods 'am;am:x=1'"
    )
    # a command the script records itself stays; a test calling main() records none
    save_result({"command": "mine"}, tmp_path / "own.json")
    assert json.loads((tmp_path / "own.json").read_text())["command"] == "mine"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/pytest", "-q"])
    assert "command" not in json.loads(save_result({}, tmp_path / "t.json").read_text())
