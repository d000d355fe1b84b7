"""One compaction server process for the module's tests (restarted once by the restart test)."""

from __future__ import annotations

import openai
import pytest

from server.servers import API_KEYS, compaction_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("compaction-server")
    process = compaction_server(root / "store", root / "server.log")
    process.start()
    yield process
    process.stop()


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def client(server):
    return _client(server, API_KEYS[0])


@pytest.fixture(scope="session")
def other_client(server):
    return _client(server, API_KEYS[1])
