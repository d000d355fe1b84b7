"""The README's Python example runs as written (the server example runs in ``tests/server``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example(kind: str) -> str:
    """The fenced python block right after ``<!-- readme-example: KIND -->`` in the README."""
    match = re.search(
        rf"<!-- readme-example: {kind} -->\s*```python\n(.*?)```",
        README.read_text(),
        re.S,
    )
    assert match, f"the README has no {kind} example"
    return match.group(1)


@pytest.mark.slow
def test_python_example_runs_as_written(tmp_path):
    script = tmp_path / "readme_example.py"
    script.write_text(readme_example("python"))
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip(), "the example printed nothing"
