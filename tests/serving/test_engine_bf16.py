"""The identity in bf16, where rounding makes "the same computation" a strict requirement.

Served from a snapshot of the engine's own K/V, an identity cache in the padded layout must give
bit for bit what the same engine gives for the plain prompt whose prefix comes from vLLM's
prefix cache: the same prefix K/V, the same pages, the same kernel over the question tokens. The
prefix is cut to whole blocks, because vLLM caches whole blocks only (a partial last block would
be recomputed on the plain side and change the rounding).

Against stock vLLM (no plugin, d = 64 pages) bf16 cannot be bit-exact: the widened pages
(d = 80) make the CPU kernel tile a long prefill differently, so the plain prompt itself rounds
differently in the two engines (decode steps are bit-equal, a 540-token prefill differs by
3e-5). That comparison is therefore the first step's top logprobs within two bf16 steps. The
varlen layout attends the prefix in fp32 torch and merges it with the kernel's bf16 output:
also a different rounding, checked the same way.
"""

from __future__ import annotations

import pytest

from serving.engines import start_llm, stop_llm
from vllm_compaction.corpus import haystack_text
from vllm_compaction.vllm import compacted_prompt
from vllm_compaction.vllm.snapshot import identity_cache, snapshot_kv

pytestmark = pytest.mark.slow

BF16_STEPS = 0.25  # bf16 logits near 20 are 0.125 apart: two steps


def _first_step(output) -> dict[int, float]:
    return {token: lp.logprob for token, lp in output.logprobs[0].items()}


def _close(a, b) -> float:
    first_a, first_b = _first_step(a), _first_step(b)
    return max(abs(first_a[t] - first_b[t]) for t in first_a.keys() & first_b.keys())


def _common(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))


def test_identity_from_an_engine_snapshot_is_bit_exact_in_bf16(smollm2, tmp_path):
    from vllm import SamplingParams

    messages = [{"role": "user", "content": "Read this essay.\n\n" + haystack_text(600, smollm2.tokenizer, seed=7)}]
    question = smollm2.turn_ids([{"role": "user", "content": "What is the essay about?"}])
    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=3)
    prime = SamplingParams(max_tokens=1, temperature=0.0)

    def from_prefix_cache(engine, prefix_ids):
        engine.generate([{"prompt_token_ids": prefix_ids, "cache_salt": "plain"}], prime, use_tqdm=False)
        return engine.generate([{"prompt_token_ids": prefix_ids + question, "cache_salt": "plain"}], params,
                               use_tqdm=False)[0].outputs[0]

    served_llm = start_llm("bfloat16", store=tmp_path, kv_snapshots=True)
    try:
        block = served_llm.llm_engine.vllm_config.cache_config.block_size
        prefix_ids = smollm2.chat_ids(messages)
        prefix_ids = prefix_ids[: len(prefix_ids) // block * block]
        assert len(prefix_ids) >= block
        plain = from_prefix_cache(served_llm, prefix_ids)
        cache = identity_cache(served_llm, snapshot_kv(served_llm, prefix_ids))
        served = {layout: served_llm.generate([compacted_prompt(cache, question, llm=served_llm, store=tmp_path,
                                                                layout=layout)], params, use_tqdm=False)[0].outputs[0]
                  for layout in ("padded", "varlen")}
    finally:
        stop_llm(served_llm)
    vanilla = start_llm("bfloat16", compaction=False)
    try:
        stock = from_prefix_cache(vanilla, prefix_ids)
    finally:
        stop_llm(vanilla)

    padded = served["padded"]
    assert len(plain.token_ids) == 64 and padded.token_ids == plain.token_ids, (padded.text, plain.text)
    for step_served, step_plain in zip(padded.logprobs, plain.logprobs):
        assert {t: lp.logprob for t, lp in step_served.items()} == {t: lp.logprob for t, lp in step_plain.items()}
    assert _close(served["varlen"], plain) < BF16_STEPS and _common(served["varlen"], plain) >= 4
    assert _close(plain, stock) < BF16_STEPS and _close(padded, stock) < BF16_STEPS
