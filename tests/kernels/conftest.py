"""Collects the kernel cases (``*_cases.py``) as one item each, run in their own interpreter
(``test_kernel_cases.py``), where ``TRITON_INTERPRET=1`` is set before Triton is imported on
CPU-only machines. Inside that interpreter the cases run as themselves and report each phase."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kernels.test_kernel_cases import (
    INLINE_ENV,
    REPORT_ENV,
    RUNS,
    CaseRuns,
    KernelCase,
    is_case_file,
)

INLINE = bool(os.environ.get(INLINE_ENV))


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RUNS] = CaseRuns()


def pytest_collect_file(
    file_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    """The case files do not match ``test_*.py``; a file named on the command line is collected
    by pytest itself."""
    if INLINE or not is_case_file(file_path) or parent.session.isinitpath(file_path):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Outside the subprocess, every case becomes a ``KernelCase`` of the same node id."""
    if INLINE:
        return
    for i, item in enumerate(items):
        if isinstance(item, pytest.Function) and is_case_file(item.path):
            case = KernelCase.from_parent(item.parent, name=item.name)
            case.own_markers.extend(
                m for m in item.iter_markers() if m.name != "parametrize"
            )
            items[i] = case


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Inside the subprocess: one JSON line per phase of each case, for the parent session."""
    path = os.environ.get(REPORT_ENV)
    if not INLINE or not path or (report.when != "call" and report.outcome == "passed"):
        return
    text = report.longreprtext
    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]
    with open(path, "a") as out:
        out.write(
            json.dumps(
                {"nodeid": report.nodeid, "outcome": report.outcome, "text": text}
            )
            + "\n"
        )
