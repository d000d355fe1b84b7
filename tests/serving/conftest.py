"""Session fixtures of the serving tests.

One compaction-enabled fp32 engine with the default (stock-width) pages serves the whole session,
and a stock engine (no plugin) the tests that compare with vanilla vLLM. They start side by side
(the stock one only where a collected test needs it) and each stops after the last test that uses
it. The widened-page, Gemma-3, bf16 and tensor-parallel engines live only as long as the module
that needs them, so at most four engines are up at once.
"""

from __future__ import annotations

import pytest

from lifetimes import release_after_last_use, used_later
from serving.engines import start_llms, stop_llm, stop_llms


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compaction-store")


@pytest.fixture(scope="session")
def fp32_engines(request, store_dir):
    """``{"llm": ..., "vanilla": ...}``, started together (``vanilla`` only if a collected test
    uses it)."""
    specs = {"llm": dict(dtype="float32", store=store_dir, kv_snapshots=True)}
    if used_later(request.session, "vanilla"):
        specs["vanilla"] = dict(dtype="float32", compaction=False)
    engines = dict(zip(specs, start_llms(*specs.values())))
    for name, engine in engines.items():
        release_after_last_use(name, lambda engine=engine: stop_llm(engine))
    yield engines
    stop_llms(*engines.values())  # those not released yet; stopping twice is harmless


@pytest.fixture(scope="session")
def llm(fp32_engines):
    """The compaction-enabled fp32 engine: default pages (stock width on CPU), KV snapshots on."""
    return fp32_engines["llm"]


@pytest.fixture(scope="session")
def vanilla(fp32_engines):
    """A stock engine: no connector, so the plugin's backend behaves exactly like vLLM's."""
    return fp32_engines["vanilla"]
