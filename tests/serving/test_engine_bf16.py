"""The identity in bf16, where rounding makes "the same computation" a strict requirement.

Three bf16 engines see the same block-aligned essay prefix (vLLM caches whole blocks only, so a
partial last block would be recomputed on one side and change the rounding):

* stock-width pages (the CPU default): a plain prompt runs vLLM's own kernel on the same pages as
  stock vLLM, so its 64 greedy tokens and every top-3 logprob equal stock vLLM's, bit for bit.
  The identity cache (t = T, beta = 0, built from the engine's own K/V snapshot) in the padded
  layout needs no bias, so its slots are written as ordinary tokens and the stock kernel reads
  them: 64 greedy tokens and every top-3 logprob equal stock vLLM's, bit for bit. Served varlen,
  its prefix is attended in fp32 torch, a different rounding: first-step logprobs within two bf16
  steps.
* widened pages: the identity cache in the padded layout gives bit for bit what the same engine
  gives for the plain prompt with its prefix from vLLM's prefix cache (same K/V, same pages, same
  kernel). Against stock vLLM it cannot be bit-exact, because the wider pages (d = 80) make the
  CPU kernel tile a long prefill differently (decode steps are bit-equal, a 540-token prefill
  differs by 3e-5): first-step logprobs within two bf16 steps.
"""

from __future__ import annotations

import pytest

from vllm_compaction.corpus import haystack_text
from vllm_compaction.vllm import compacted_prompt
from vllm_compaction.vllm.snapshot import identity_cache, snapshot_kv

from serving.engines import start_llms, stop_llms

pytestmark = pytest.mark.slow

BF16_STEPS = 0.25  # bf16 logits near 20 are 0.125 apart: two steps


def _first_step(output) -> dict[int, float]:
    return {token: lp.logprob for token, lp in output.logprobs[0].items()}


def _close(a, b) -> float:
    first_a, first_b = _first_step(a), _first_step(b)
    return max(abs(first_a[t] - first_b[t]) for t in first_a.keys() & first_b.keys())


def _common(a, b) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
        len(a.token_ids),
    )


def _same_steps(a, b) -> bool:
    def steps(output):
        return [
            {token: lp.logprob for token, lp in step.items()}
            for step in output.logprobs
        ]

    return steps(a) == steps(b)


def test_bf16_plain_traffic_and_identity_caches_are_exact_where_the_kernel_is_shared(
    smollm2, tmp_path
):
    from vllm import SamplingParams

    messages = [
        {
            "role": "user",
            "content": "Read this essay.\n\n"
            + haystack_text(600, smollm2.tokenizer, seed=7),
        }
    ]
    question = smollm2.turn_ids(
        [{"role": "user", "content": "What is the essay about?"}]
    )
    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=3)
    prime = SamplingParams(max_tokens=1, temperature=0.0)
    block = 128  # vLLM's CPU default block size, checked below
    prefix_ids = smollm2.chat_ids(messages)
    prefix_ids = prefix_ids[: len(prefix_ids) // block * block]
    assert len(prefix_ids) >= block

    def from_prefix_cache(engine):
        assert engine.llm_engine.vllm_config.cache_config.block_size == block
        engine.generate(
            [{"prompt_token_ids": prefix_ids, "cache_salt": "plain"}],
            prime,
            use_tqdm=False,
        )
        return engine.generate(
            [{"prompt_token_ids": prefix_ids + question, "cache_salt": "plain"}],
            params,
            use_tqdm=False,
        )[0].outputs[0]

    def serve(engine, pages: str, *layouts: str):
        """The plain prompt, and the identity cache from the engine's own snapshot in each layout,
        on one engine."""
        plain = from_prefix_cache(engine)
        cache = identity_cache(engine, snapshot_kv(engine, prefix_ids))
        prompts = [
            compacted_prompt(
                cache, question, llm=engine, store=tmp_path / pages, layout=layout
            )
            for layout in layouts
        ]
        # one at a time, as stock vLLM runs it: the batch's shape could change GEMM rounding
        return plain, *(
            engine.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts
        )

    # started side by side, run one after another (each takes both cores)
    engines = start_llms(
        *(
            dict(
                dtype="bfloat16", store=tmp_path / pages, kv_snapshots=True, pages=pages
            )
            for pages in ("stock", "widened")
        ),
        dict(dtype="bfloat16", compaction=False),
    )
    try:
        stock_plain, varlen, stock_padded = serve(
            engines[0], "stock", "varlen", "padded"
        )
        widened_plain, padded = serve(engines[1], "widened", "padded")
        stock = from_prefix_cache(engines[2])
    finally:
        stop_llms(*engines)

    # stock-width pages: plain traffic is stock vLLM's computation, bit for bit
    assert len(stock.token_ids) == 64 and stock_plain.token_ids == stock.token_ids
    assert _same_steps(stock_plain, stock)
    # stock-width pages: the bias-free padded identity is read by the stock kernel, bit for bit
    assert stock_padded.token_ids == stock.token_ids, (stock_padded.text, stock.text)
    assert _same_steps(stock_padded, stock)
    # widened pages: the padded identity is the same engine's plain prompt, bit for bit
    assert padded.token_ids == widened_plain.token_ids, (
        padded.text,
        widened_plain.text,
    )
    assert _same_steps(padded, widened_plain)
    # different roundings: close
    assert _close(varlen, stock) < BF16_STEPS and _common(varlen, stock) >= 4
    assert (
        _close(widened_plain, stock) < BF16_STEPS and _close(padded, stock) < BF16_STEPS
    )
