"""The README's server example (the ``openai`` client against ``vllm-compaction serve``) runs as
written, pointed at this module's server through the variables it documents."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server.servers import API_KEYS

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def test_server_example_runs_as_written(server, tmp_path):
    match = re.search(
        r"<!-- readme-example: server -->\s*```python\n(.*?)```",
        README.read_text(),
        re.S,
    )
    assert match, "the README has no server example"
    script = tmp_path / "readme_server_example.py"
    script.write_text(match.group(1))
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"{server.url}/v1",
        "OPENAI_API_KEY": API_KEYS[0],
    }
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip(), "the example printed nothing"
