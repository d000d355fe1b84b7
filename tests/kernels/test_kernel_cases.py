"""Runs each Triton kernel's cases (``*_cases.py``) in a fresh interpreter, one pytest item per case.

The Triton interpreter (``TRITON_INTERPRET=1``, the only way to run the kernels on a CPU-only
machine) must be on before ``triton`` is first imported, and by the time a case runs, the
session has usually imported it already through vLLM or torch. So the cases are collected here
like any test (importing a case file imports no Triton), each one its own item named after
its case, but run in a subprocess: the first item of a file runs every selected case of that
file in one fresh interpreter (one start, one set of compiles, as before) and each item then
reports its own case's outcome and failure. ``conftest.py`` wires this up; on a CUDA machine
``tests/cuda`` runs the same files compiled through :func:`run_cases`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CASES = sorted(p for p in HERE.glob("*_cases.py") if not p.name.startswith("test_"))
#: Set in the subprocess: the case files run as themselves there.
INLINE_ENV = "VLLM_COMPACTION_KERNEL_CASES_INLINE"
#: Where the subprocess writes one JSON line per test phase.
REPORT_ENV = "VLLM_COMPACTION_KERNEL_CASES_REPORT"


def is_case_file(path: Path) -> bool:
    return path.parent == HERE and path in CASES


def run_cases(
    path: Path,
    *,
    interpret: bool,
    node_ids: list[str] | None = None,
    report: Path | None = None,
    collect_only: bool = False,
) -> subprocess.CompletedProcess:
    """Run the cases of ``path`` (or only ``node_ids`` of it) in a fresh interpreter; with
    ``report``, each phase's outcome is written there as JSON lines; with ``collect_only``,
    list their node ids instead (``case_ids``)."""
    # one tile configuration: fewer compiles
    env = {
        **os.environ,
        "VLLM_COMPACTION_TUNE": "0",
        INLINE_ENV: "1",
    }
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    if report is not None:
        env[REPORT_ENV] = str(report)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfE",
            "-p",
            "no:cacheprovider",
            *(["--collect-only"] if collect_only else []),
            *(node_ids or [str(path)]),
        ],
        cwd=path.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def case_ids(path: Path) -> list[str]:
    """The node ids of a case file's cases, as its own subprocess collects them."""
    proc = run_cases(path, interpret=False, collect_only=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    if not ids:
        raise RuntimeError(
            f"no cases collected from {path}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return ids


@dataclass
class Outcome:
    """One case's result in the subprocess: ``passed``, ``failed`` or ``skipped``, and why."""

    outcome: str
    text: str = ""


class CaseRuns:
    """The outcomes of the cases run so far in this session, by node id."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Outcome] = {}

    def outcome(self, item: pytest.Item) -> Outcome:
        if item.nodeid not in self.outcomes:
            self._run(item)
        return self.outcomes.get(item.nodeid) or Outcome(
            "failed", "the case was not reported by its subprocess"
        )

    def _run(self, item: pytest.Item) -> None:
        """Run every selected, not yet run case of ``item``'s file in one subprocess."""
        ids = [
            i.nodeid
            for i in item.session.items
            if isinstance(i, KernelCase)
            and i.path == item.path
            and i.nodeid not in self.outcomes
        ]
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.jsonl"
            proc = run_cases(
                item.path,
                interpret=not torch.cuda.is_available(),
                node_ids=ids,
                report=report,
            )
            lines = report.read_text().splitlines() if report.exists() else []
        for entry in map(json.loads, lines):
            seen = self.outcomes.get(entry["nodeid"])
            # a failure or a skip in any phase stands
            if seen is None or seen.outcome == "passed":
                self.outcomes[entry["nodeid"]] = Outcome(
                    entry["outcome"], entry["text"]
                )
        tail = proc.stdout[-4000:] + proc.stderr[-2000:]
        for nodeid in ids:  # a case the subprocess never reached fails with its output
            self.outcomes.setdefault(
                nodeid, Outcome("failed", f"exit status {proc.returncode}\n{tail}")
            )


class KernelCase(pytest.Item):
    """One case of a ``*_cases.py`` file, run in the file's subprocess."""

    def runtest(self) -> None:
        result = self.config.stash[RUNS].outcome(self)
        if result.outcome == "skipped":
            pytest.skip(result.text)
        if result.outcome != "passed":
            raise CaseFailed(result.text)

    def repr_failure(
        self, excinfo: pytest.ExceptionInfo[BaseException], style=None
    ) -> str:
        if isinstance(excinfo.value, CaseFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


class CaseFailed(Exception):
    """A case failed in its subprocess; the message is its report there."""


RUNS = pytest.StashKey[CaseRuns]()
