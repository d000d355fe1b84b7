"""Session fixtures of the serving tests.

One compaction-enabled fp32 engine with the default (stock-width) pages serves the whole session;
the vanilla, widened-page and bf16 engines live only as long as the module that needs them, so at
most three engines are up at once.
"""

from __future__ import annotations

import pytest

from serving.engines import start_llm, stop_llm


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compaction-store")


@pytest.fixture(scope="session")
def llm(store_dir):
    """The compaction-enabled fp32 engine: default pages (stock width on CPU), KV snapshots on."""
    engine = start_llm("float32", store=store_dir, kv_snapshots=True)
    yield engine
    stop_llm(engine)
