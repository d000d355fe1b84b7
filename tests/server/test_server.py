"""The OpenAI-compatible server end to end: a real ``vllm-compaction serve`` process with SmolLM2,
its local worker, and the official ``openai`` client.

Ordered: the restart test runs last and reuses what the earlier tests stored.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import openai
import pytest

from server.servers import (
    AUTO_THRESHOLD_TOKENS,
    MODEL,
    all_compactions,
    job_record,
    store_of,
    wait_finished,
    wait_status,
    worker_pid,
)

pytestmark = pytest.mark.slow

FACT = "The secret code of the vault is 7319."
QUESTION = "What is the secret code of the vault?"
ANSWER = "7319"
METHOD = {
    "method": "am-highest-attn",
    "queries": "repeat-prefill",
    "min_layer_share": 0.3,
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_compaction.models import resolve

    return AutoTokenizer.from_pretrained(resolve(MODEL))


def planted_conversation(tokenizer, n_tokens: int, seed: int = 0) -> list[dict]:
    from vllm_compaction.corpus import haystack_text

    text = haystack_text(n_tokens, tokenizer, seed=seed)
    cut = text.find(". ", len(text) // 3) + 2
    return [
        {
            "role": "user",
            "content": f"Read this and remember the code.\n\n{text[:cut]}{FACT} {text[cut:]}",
        },
        {
            "role": "assistant",
            "content": "I have read it and I will remember the code.",
        },
    ]


def ask(client, messages, **extra_body):
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        extra_body=extra_body or None,
    )


def compact(client, **body) -> dict:
    return client.post("/compact", body={"model": MODEL, **body}, cast_to=object)


@pytest.fixture(scope="module")
def fact_compaction(client, tokenizer):
    """A 700-token conversation with a planted fact, compacted to 20% through /v1/compact."""
    messages = planted_conversation(tokenizer, 700)
    created = compact(client, messages=messages, ratio=0.2, **METHOD)
    assert created["object"] == "compaction" and created["status"] in (
        "queued",
        "running",
    )
    assert created["original_tokens"] > 700 and created["messages_covered"] == 2
    return messages, wait_finished(client, created["id"])


def test_planted_fact_from_compaction_id(client, fact_compaction):
    messages, job = fact_compaction
    assert job["status"] == "succeeded", job
    assert job["compacted_tokens"] < 0.7 * job["original_tokens"]
    assert (
        job["bytes_saved"] > 0
        and job["progress"] == 1.0
        and job["min_layer_share"] == 0.3
    )
    assert {"queued_s", "fit_s", "total_s"} <= job["timings"].keys()
    question = messages + [{"role": "user", "content": QUESTION}]
    full = ask(client, question)
    # the model knows it with the whole context
    assert ANSWER in full.choices[0].message.content

    served = ask(client, question, compaction_id=job["id"])
    assert ANSWER in served.choices[0].message.content
    usage = served.usage.model_dump()
    assert usage["logical_prompt_tokens"] == full.usage.prompt_tokens
    assert (
        usage["physical_prompt_tokens"]
        == served.usage.prompt_tokens
        < full.usage.prompt_tokens
    )
    # only the new turn, without the covered history: the same prompt
    new_turn_only = ask(
        client, [{"role": "user", "content": QUESTION}], compaction_id=job["id"]
    )
    assert new_turn_only.choices[0].message.content == served.choices[0].message.content


def test_completions_and_streaming_continue_a_compaction(client, fact_compaction):
    _, job = fact_compaction
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"compaction_id": job["id"]},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert ANSWER in text
    assert (
        chunks[-1].usage.model_dump()["logical_prompt_tokens"]
        > chunks[-1].usage.prompt_tokens
    )
    completion = client.completions.create(
        model=MODEL,
        prompt="<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n",
        max_tokens=24,
        temperature=0,
        extra_body={"compaction_id": job["id"]},
    )
    assert ANSWER in completion.choices[0].text


def test_requests_during_a_job_complete_and_latency_is_recorded(
    client, tokenizer, fact_compaction, record_property
):
    messages, _ = fact_compaction
    question = messages + [{"role": "user", "content": QUESTION}]

    def latency() -> float:
        start = time.perf_counter()
        assert ANSWER in ask(client, question).choices[0].message.content
        return time.perf_counter() - start

    idle = [latency() for _ in range(3)]
    job = compact(
        client,
        messages=planted_conversation(tokenizer, 1500, seed=1),
        ratio=0.2,
        **METHOD,
    )
    wait_status(client, job["id"], ("running",))
    busy = []
    while (
        len(busy) < 3
        or client.get(f"/compact/{job['id']}", cast_to=object)["status"] == "running"
    ):
        busy.append(latency())
        if len(busy) >= 12:
            break
    assert wait_finished(client, job["id"])["status"] == "succeeded"
    record_property("latency_idle_s", statistics.median(idle))
    record_property("latency_during_job_s", statistics.median(busy))
    print(
        f"\nchat latency median: idle {statistics.median(idle):.2f} s, "
        f"during a compaction job {statistics.median(busy):.2f} s ({len(busy)} requests)"
    )


def test_auto_compaction_by_conversation_id(client, tokenizer):
    messages = planted_conversation(tokenizer, AUTO_THRESHOLD_TOKENS + 200, seed=2)
    conversation = "conv-auto-1"
    first = ask(
        client,
        messages + [{"role": "user", "content": "Thanks. Say OK."}],
        conversation_id=conversation,
    )
    # served as sent; compaction queued
    assert "logical_prompt_tokens" not in first.usage.model_dump()
    jobs = [j for j in all_compactions(client) if j["conversation_id"] == conversation]
    assert len(jobs) == 1 and jobs[0]["messages_covered"] == 3
    job = wait_finished(client, jobs[0]["id"])
    assert job["status"] == "succeeded", job

    history = messages + [
        {"role": "user", "content": "Thanks. Say OK."},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": QUESTION},
    ]
    later = ask(client, history, conversation_id=conversation)
    usage = later.usage.model_dump()
    assert usage["compaction_id"] == job["id"]
    assert usage["physical_prompt_tokens"] < usage["logical_prompt_tokens"]
    assert ANSWER in later.choices[0].message.content


def test_invalid_input_gets_4xx_with_a_message(
    client, other_client, fact_compaction, server
):
    _, job = fact_compaction
    cases = [
        (lambda: client.get("/compact/cmp_doesnotexist", cast_to=object), 404),
        (
            lambda: compact(
                client, messages=[{"role": "user", "content": "hi"}], ratio=0
            ),
            (400, 422),
        ),
        (
            lambda: compact(
                client, messages=[{"role": "user", "content": "hi"}], ratio=1.5
            ),
            (400, 422),
        ),
        (
            lambda: client.post(
                "/compact",
                body={"model": "gpt-4", "prompt": "hi", "ratio": 0.5},
                cast_to=object,
            ),
            404,
        ),
        (lambda: compact(client, messages=[{"content": "no role"}], ratio=0.5), 400),
        (lambda: compact(client, messages="not a list", ratio=0.5), (400, 422)),
        (
            lambda: compact(client, prompt="hi", ratio=0.5, method="no-such-method"),
            (400, 422),
        ),
        (
            lambda: compact(
                client, prompt="hi", ratio=0.5, method="snapkv", min_layer_share=0.3
            ),
            (400, 422),
        ),
        (
            lambda: ask(
                other_client,
                [{"role": "user", "content": QUESTION}],
                compaction_id=job["id"],
            ),
            404,
        ),
        (lambda: other_client.get(f"/compact/{job['id']}", cast_to=object), 404),
        (
            lambda: ask(
                client,
                [{"role": "user", "content": QUESTION}],
                compaction_id="cmp_unknown",
            ),
            404,
        ),
        (
            lambda: ask(
                client,
                [{"role": "user", "content": "x"}],
                cache_salt=f"vllm-compaction:1:{job['id']}:1:" + "0" * 32,
            ),
            400,
        ),
    ]
    for call, expected in cases:
        with pytest.raises(openai.APIStatusError) as info:
            call()
        expected = expected if isinstance(expected, tuple) else (expected,)
        assert info.value.status_code in expected, (
            info.value.status_code,
            info.value.response.text,
        )
        assert len(info.value.response.text) > 20  # a sentence, not a bare code
    # no key at all: vLLM's --api-key guard applies to the new routes too
    assert httpx.get(f"{server.url}/v1/compact", timeout=10).status_code == 401
    # still serving
    assert (
        ANSWER
        in ask(client, [{"role": "user", "content": QUESTION}], compaction_id=job["id"])
        .choices[0]
        .message.content
    )


def test_a_killed_worker_s_job_runs_again_and_serving_goes_on(
    server, client, tokenizer, fact_compaction
):
    _, stored = fact_compaction
    job = compact(
        client,
        messages=planted_conversation(tokenizer, 1500, seed=3),
        ratio=0.2,
        **METHOD,
    )
    running = wait_status(client, job["id"], ("running",))
    time.sleep(2.0)
    os.kill(worker_pid(server, running["id"]), signal.SIGKILL)
    # the supervisor queues the job again (after a backoff) and the restarted worker runs it
    retried = wait_status(client, job["id"], ("queued",), timeout_s=60)
    assert retried["attempts"] == 1 and "signal 9" in retried["error"], retried
    done = wait_finished(client, job["id"], timeout_s=600)
    assert (
        done["status"] == "succeeded"
        and done["attempts"] == 2
        and done["error"] is None
    ), done
    # serving goes on, the stored compaction is intact, and the restarted worker takes new jobs
    reply = ask(
        client, [{"role": "user", "content": QUESTION}], compaction_id=stored["id"]
    )
    assert ANSWER in reply.choices[0].message.content
    again = compact(
        client,
        prompt="A short note: the meeting moved to Tuesday at noon.",
        ratio=0.5,
        **METHOD,
    )
    assert wait_finished(client, again["id"], timeout_s=300)["status"] == "succeeded"


def test_cancel_mid_job(client, tokenizer):
    job = compact(
        client,
        messages=planted_conversation(tokenizer, 1500, seed=4),
        ratio=0.2,
        **METHOD,
    )
    wait_status(client, job["id"], ("running",))
    time.sleep(1.0)
    deleted = client.delete(f"/compact/{job['id']}", cast_to=object)
    assert deleted == {
        "id": job["id"],
        "object": "compaction.deleted",
        "deleted": False,
        "status": "cancelled",
    }
    assert client.get(f"/compact/{job['id']}", cast_to=object)["status"] == "cancelled"
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, [{"role": "user", "content": QUESTION}], compaction_id=job["id"])
    assert info.value.status_code == 409
    # the worker dropped it and is free for the next job
    after = compact(
        client, prompt="Another note: bring the blue folder.", ratio=0.5, **METHOD
    )
    assert wait_finished(client, after["id"], timeout_s=300)["status"] == "succeeded"
    gone = client.delete(f"/compact/{after['id']}", cast_to=object)
    assert gone["deleted"] is True


def test_corrupt_cache_fails_its_request_with_a_reason_and_is_quarantined(
    client, server
):
    job = wait_finished(
        client,
        compact(client, prompt="The vault code is 7319. " * 20, ratio=0.5, **METHOD)[
            "id"
        ],
    )
    store = store_of(server)
    path = store / f"{job['id']}.safetensors"
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)
    path.write_bytes(bytes(data))
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, [{"role": "user", "content": QUESTION}], compaction_id=job["id"])
    assert (
        info.value.status_code == 500
        and "could not be loaded" in info.value.response.text
    )
    assert not path.exists() and any((store / "quarantine").iterdir())
    # still serving
    assert (
        ask(client, [{"role": "user", "content": "Say hi."}]).choices[0].message.content
    )
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, [{"role": "user", "content": QUESTION}], compaction_id=job["id"])
    assert info.value.status_code == 410


def test_metrics_and_openapi(server):
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in (
        "vllm_compaction_jobs{",
        "vllm_compaction_queue_length",
        "vllm_compaction_stage_seconds_bucket",
        "vllm_compaction_ratio_bucket",
        "vllm_compaction_bytes_saved_total",
        "vllm_compaction_requests_total",
    ):
        assert name in text, name
    # the job whose worker was killed ran again and succeeded: nothing failed in this session
    assert (
        'vllm_compaction_jobs{status="failed"} 0.0' in text
        and 'vllm_compaction_jobs{status="succeeded"}' in text
    )
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert (
        "/v1/compact" in schema["paths"]
        and "/v1/compact/{compaction_id}" in schema["paths"]
    )
    assert {"CompactRequest", "Compaction"} <= schema["components"]["schemas"].keys()


def test_a_killed_server_restarts_with_its_jobs_and_a_separate_worker_runs_them(
    server, client, tokenizer, fact_compaction
):
    """kill -9 of the whole server (API server, engine, local worker) with one job running and one
    queued: after the restart the stored caches serve, both jobs are back in the queue, a worker
    started by hand runs them, and no temp file of the killed server is left in the store."""
    _, job = fact_compaction
    running = compact(
        client,
        messages=planted_conversation(tokenizer, 1500, seed=5),
        ratio=0.2,
        **METHOD,
    )
    wait_status(client, running["id"], ("running",))
    queued = compact(
        client, prompt="A note to keep: the boat leaves at dawn.", ratio=0.5, **METHOD
    )
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    # jobs now wait for a worker started by hand
    server.flags += [
        "--compaction-workers",
        "0",
    ]
    server.start()
    found = client.get(f"/compact/{job['id']}", cast_to=object)
    assert (
        found["status"] == "succeeded"
        and found["compacted_tokens"] == job["compacted_tokens"]
    )
    reply = ask(
        client, [{"role": "user", "content": QUESTION}], compaction_id=job["id"]
    )
    assert ANSWER in reply.choices[0].message.content
    assert job["id"] in {j["id"] for j in all_compactions(client)}
    time.sleep(3.0)
    # the server's death is not the job's: no attempt counted
    for pending in (
        running,
        queued,
    ):
        record = client.get(f"/compact/{pending['id']}", cast_to=object)
        assert record["status"] == "queued" and record["attempts"] == 0, record

    worker_cmd = [
        sys.executable,
        "-m",
        "vllm_compaction.cli",
        "worker",
        "--server",
        server.url,
    ]
    refused = subprocess.run(
        worker_cmd + ["--token", "wrong-token-0123456789"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "refused the worker token" in refused.stderr
    store = store_of(server)
    # reads <store>/worker-token
    worker = subprocess.Popen(worker_cmd + ["--store", str(store)])
    try:
        for pending in (queued, running):
            done = wait_finished(client, pending["id"], timeout_s=600)
            assert done["status"] == "succeeded" and done.get("worker_id") is None, done
            assert job_record(server, done["id"])["worker_id"].endswith(
                f":{worker.pid}"
            )
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    leftovers = [p for p in store.rglob("*.tmp") if "quarantine" not in p.parts]
    assert not leftovers, leftovers
    assert (
        ask(
            client, [{"role": "user", "content": QUESTION}], compaction_id=running["id"]
        )
        .choices[0]
        .message.content
    )


def test_two_uploads_for_one_job_one_wins_and_its_cache_serves(
    server, client, smollm2, tmp_path
):
    """Runs after the restart (no local worker): this test claims a job with the worker
    token, computes its cache and sends it twice at once. One upload wins, the other is
    refused with 409, and the winner's cache is the one stored and served."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_compaction.pipeline import compact as compact_cache

    store = store_of(server)
    base = f"{server.url}/compaction/worker/v1"
    auth = {"Authorization": f"Bearer {(store / 'worker-token').read_text().strip()}"}
    job = compact(
        client,
        prompt="Two uploads race: the ferry leaves at six from pier 9.",
        ratio=0.5,
        **METHOD,
    )
    claimed = httpx.post(
        f"{base}/claim", json={"worker_id": "racer"}, headers=auth, timeout=60
    ).json()
    assert claimed["id"] == job["id"], claimed
    claim = {**auth, "X-Job-Token": claimed["token"], "X-Worker-Id": "racer"}
    beat = httpx.post(
        f"{base}/jobs/{job['id']}/heartbeat",
        json={"worker_id": "racer"},
        headers=claim,
        timeout=60,
    )
    assert beat.json()["action"] == "continue"
    cache = compact_cache(
        smollm2,
        claimed["messages"],
        ratio=claimed["ratio"],
        method=claimed["method"],
        queries=claimed["queries"],
        keep_last_tokens=claimed["keep_last_tokens"],
    )
    cache.save(tmp_path / "result.safetensors")
    data = (tmp_path / "result.safetensors").read_bytes()

    def upload(_: int) -> httpx.Response:
        return httpx.put(
            f"{base}/jobs/{job['id']}/result", content=data, headers=claim, timeout=120
        )

    with ThreadPoolExecutor(2) as pool:
        codes = sorted(r.status_code for r in pool.map(upload, range(2)))
    assert codes == [200, 409], codes
    assert len(list(store.glob(f"{job['id']}*.safetensors"))) == 1
    assert not list(store.glob(".upload-*.tmp"))
    done = client.get(f"/compact/{job['id']}", cast_to=object)
    assert done["status"] == "succeeded" and done["compacted_tokens"], done
    reply = ask(
        client,
        [{"role": "user", "content": "When does the ferry leave?"}],
        compaction_id=job["id"],
    )
    assert reply.choices[0].message.content
