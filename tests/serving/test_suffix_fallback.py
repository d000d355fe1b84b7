"""Stock-width pages: the fallback that attends the tokens after a packed prefix from the pages
read back in torch. In production only the rare tokens whose two-call merge is ill-conditioned
take it; an engine of its own, started with ``SUFFIX_FROM_PAGES_ENV``, sends every token there."""

from __future__ import annotations

import os

import pytest

from vllm_compaction.reference import ReferenceDecoder
from vllm_compaction.vllm import compacted_prompt
from vllm_compaction.vllm.cpu_backend import SUFFIX_FROM_PAGES_ENV

from serving.engines import start_llm, stop_llm
from serving.test_engine import _first_logprob_gap, greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fallback_llm(store_dir):
    """A stock-width fp32 engine whose engine process attends every suffix from the pages."""
    os.environ[SUFFIX_FROM_PAGES_ENV] = "1"
    try:
        engine = start_llm("float32", store=store_dir)
    finally:
        del os.environ[SUFFIX_FROM_PAGES_ENV]
    yield engine
    stop_llm(engine)


def test_suffix_from_pages_agrees_with_reference_and_with_the_two_call_merge(
    fallback_llm, llm, smollm2, niah_cases, store_dir
):
    """Prefill of the question (one chunk per request) and decode steps (one row per token) both
    go through the fallback: same tokens as the reference decoder and as the session engine's
    two-call merge, first-step logits within 1e-3; the logprobs differ from the merge's in the
    last bits, which shows the other path really ran."""
    inst, prompt, cache = niah_cases[0]
    reference = ReferenceDecoder(smollm2).generate(
        cache, prompt.continuation_ids, max_new_tokens=12
    )
    served = {}
    for name, engine in (("pages", fallback_llm), ("merge", llm)):
        request = compacted_prompt(
            cache, prompt.continuation_ids, llm=engine, store=store_dir
        )
        served[name] = engine.generate([request], greedy(12, logprobs=5))[0].outputs[0]
        assert served[name].token_ids == reference.token_ids, (
            name,
            served[name].text,
            reference.text,
        )
        assert _first_logprob_gap(served[name], reference.first_logits) < 1e-3
    gaps = [
        abs(a[t].logprob - b[t].logprob)
        for a, b in zip(served["pages"].logprobs, served["merge"].logprobs)
        for t in a.keys() & b.keys()
    ]
    assert 0 < max(gaps) < 1e-3
