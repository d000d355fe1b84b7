"""The server under tensor parallelism: ``vllm-compaction serve --tensor-parallel-size 2`` (one CPU
core per rank), its local worker compacting through ``POST /v1/compact``, and completions from
the compacted prefix agreeing with the reference decoder on the cache the worker stored.

The model is the small random-weight Llama of ``serving/test_tensor_parallel.py`` (2 KV heads,
one per rank). The prompt is the prefix the server rendered for the job, the continuation plain
text, so the reference decoder sees the very tokens the engine does.

Its jobs take seconds even on a busy machine, so this server alone runs with a short job deadline
(``--compaction-job-timeout-s``), which the frozen-computation test needs; a SmolLM2 server
under the suite's load would hit it with ordinary jobs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest
import torch

from vllm_compaction.cache import LocalDiskStore
from vllm_compaction.corpus import haystack_text
from vllm_compaction.reference import ReferenceDecoder
from vllm_compaction.vllm.server_process import ServerProcess, cpu_engine_flags

from server.servers import (
    compute_child,
    local_workers,
    store_of,
    wait_finished,
    wait_status,
)
from serving.engines import random_llama_checkpoint

pytestmark = pytest.mark.slow

NAME = "tiny-llama-tp2"
CONTINUATION = " In summary, the essay"
STEPS = 8
JOB_TIMEOUT_S = 45.0


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-server")
    model_dir = random_llama_checkpoint(root / "model")
    process = ServerProcess(
        str(model_dir),
        [
            *cpu_engine_flags(max_num_seqs=4),
            "--tensor-parallel-size",
            "2",
            "--served-model-name",
            NAME,
            "--compaction-store",
            str(root / "store"),
            "--compaction-job-timeout-s",
            str(JOB_TIMEOUT_S),
        ],
        root / "server.log",
    )
    try:
        process.start()
        yield process, model_dir, root / "store"
    finally:
        process.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)


def _compact(client: openai.OpenAI, text: str) -> dict:
    return client.post(
        "/compact",
        body={"model": NAME, "prompt": text, "ratio": 0.2, "method": "am-highest-attn"},
        cast_to=object,
    )


def test_a_compaction_made_and_served_under_tp2_matches_the_reference(tp_server):
    server, model_dir, store = tp_server
    client = _client(server)
    decoder = ReferenceDecoder(model_dir)
    text = haystack_text(400, decoder.adapter.tokenizer, seed=5)
    job = wait_finished(client, _compact(client, text)["id"], timeout_s=600)
    assert job["status"] == "succeeded", (job, server.log_tail())
    cache = LocalDiskStore(store).get_id(job["id"])
    assert cache is not None and cache.logical_length == job["original_tokens"]
    assert job["compacted_tokens"] < 0.5 * job["original_tokens"]

    served = client.completions.create(
        model=NAME,
        prompt=CONTINUATION,
        max_tokens=STEPS,
        temperature=0,
        logprobs=1,
        extra_body={"compaction_id": job["id"]},
    )
    usage = served.usage.model_dump()
    continuation = decoder.adapter.encode(CONTINUATION)
    assert usage["logical_prompt_tokens"] == cache.logical_length + len(continuation)
    reference = decoder.generate(cache, continuation, max_new_tokens=STEPS)
    choice = served.choices[0]
    assert choice.text == reference.text
    # the first token's logprob, from the two ranks' halves of the heads: within 1e-3 in fp32
    first = torch.log_softmax(reference.first_logits.double(), -1)[
        reference.token_ids[0]
    ].item()
    assert abs(choice.logprobs.token_logprobs[0] - first) < 1e-3
    # a chat turn on the compaction: the chat template's tokens after the prefix
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "And then?"}],
        max_tokens=STEPS,
        temperature=0,
        extra_body={"compaction_id": job["id"]},
    )
    reference = decoder.generate(
        cache, [{"role": "user", "content": "And then?"}], max_new_tokens=STEPS
    )
    assert chat.choices[0].message.content == reference.text
    assert chat.usage.model_dump()["logical_prompt_tokens"] > cache.logical_length


def test_a_frozen_computation_fails_at_its_deadline_and_the_worker_goes_on(tp_server):
    """The worker's compute process hangs (SIGSTOP before the job reaches it): the worker
    still heartbeats, so only the job's deadline can end it. It fails with the reason, the
    worker kills the frozen process and starts a fresh one, the next job succeeds and the
    failed one left nothing in the store."""
    server, _, _ = tp_server
    client = _client(server)
    (worker,) = local_workers(server)
    frozen = compute_child(worker)
    os.kill(frozen, signal.SIGSTOP)
    try:
        job = _compact(client, "A note on the frozen computation. " * 20)
        wait_status(client, job["id"], ("running",), timeout_s=60)
        done = wait_finished(client, job["id"], timeout_s=JOB_TIMEOUT_S + 60)
    finally:
        if Path(f"/proc/{frozen}").exists():
            os.kill(frozen, signal.SIGCONT)
    assert done["status"] == "failed" and "deadline" in done["error"], done
    for _ in range(60):  # the worker reaps the frozen process at its next heartbeat
        if not Path(f"/proc/{frozen}").exists():
            break
        time.sleep(0.5)
    assert not Path(f"/proc/{frozen}").exists()
    assert local_workers(server) == [worker] and compute_child(worker) != frozen
    again = _compact(client, "A note on the frozen computation. " * 20)
    assert wait_finished(client, again["id"], 300)["status"] == "succeeded"
    assert not list(store_of(server).glob(f"{job['id']}*"))
