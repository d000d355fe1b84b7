"""The server under tensor parallelism: ``vllm-compaction serve --tensor-parallel-size 2`` (one CPU
core per rank), its local worker compacting through ``POST /v1/compact``, and completions from
the compacted prefix agreeing with the reference decoder on the cache the worker stored.

The model is the small random-weight Llama of ``serving/test_tensor_parallel.py`` (2 KV heads,
one per rank). The prompt is the prefix the server rendered for the job, the continuation plain
text, so the reference decoder sees the very tokens the engine does.
"""

from __future__ import annotations

import openai
import pytest
import torch

from vllm_compaction.cache import LocalDiskStore
from vllm_compaction.corpus import haystack_text
from vllm_compaction.reference import ReferenceDecoder
from vllm_compaction.vllm.server_process import ServerProcess, cpu_engine_flags

from server.servers import wait_finished
from serving.engines import random_llama_checkpoint

pytestmark = pytest.mark.slow

NAME = "tiny-llama-tp2"
CONTINUATION = " In summary, the essay"
STEPS = 8


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
        ],
        root / "server.log",
    )
    try:
        process.start()
        yield process, model_dir, root / "store"
    finally:
        process.stop()


def test_a_compaction_made_and_served_under_tp2_matches_the_reference(tp_server):
    server, model_dir, store = tp_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
    decoder = ReferenceDecoder(model_dir)
    text = haystack_text(400, decoder.adapter.tokenizer, seed=5)
    created = client.post(
        "/compact",
        body={
            "model": NAME,
            "prompt": text,
            "ratio": 0.2,
            "method": "am-highest-attn",
        },
        cast_to=object,
    )
    job = wait_finished(client, created["id"], timeout_s=600)
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
