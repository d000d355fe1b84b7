"""Reference-query sources: plans, packing, caps, norms, on-policy collection."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_compaction.eval.niah import make_needle, needle_prompt
from vllm_compaction.eval.tasks import make_task, task_prompt
from vllm_compaction.pipeline import PreparedPrefix, compact_prefix, compact_prepared
from vllm_compaction.queries import (
    QueryCollector,
    QueryPlan,
    auto_spacing,
    parse_sources,
    resolve_spacing,
)
from vllm_compaction.queries.base import PrefixSpec
from vllm_compaction.queries.quote_prefill import QuotePrefill
from vllm_compaction.queries.repeat_prefill import REPEAT_INSTRUCTION
from vllm_compaction.queries.self_study import SelfStudy
from vllm_compaction.queries.surprise_cloze import BLANK, SurpriseCloze
from vllm_compaction.queries.surprise_quote import (
    SurpriseEntityQuote,
    SurpriseNameQuote,
    SurpriseNumberQuote,
    SurpriseQuote,
    name_starts,
    name_words,
    number_starts,
    number_words,
    surprising_spans,
)
from vllm_compaction.queries.surprise_recap import (
    RECAP_QUESTION,
    SurpriseRecap,
    second_person,
)
from vllm_compaction.text import token_pieces

IDS = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(4)).tolist()


def _spec(adapter, ids=IDS):
    mask = torch.ones(len(ids), dtype=torch.bool)
    mask[:3] = False
    return PrefixSpec(torch.tensor(ids), mask, adapter.prefill(ids))


def _task_spec(adapter, task: str, seed: int):
    """An evaluation instance of 1,500 tokens and its prefix, prefilled."""
    inst = make_task(task, adapter.tokenizer, 1500, seed=seed)
    prompt = task_prompt(adapter, inst)
    kv = adapter.prefill(prompt.prefix_ids)
    return inst, PrefixSpec(torch.tensor(prompt.prefix_ids), prompt.compact_mask, kv)


def test_collector_records_only_marked_rows_and_caps(tiny_llama):
    spec = _spec(tiny_llama)
    plan = QueryPlan(
        continuations=[[1, 2, 3, 4], [5, 6]], record_from=[2, 0], prefix_queries=True
    )
    queries = QueryCollector(tiny_llama, spec, plan).run(spec.kv.exact_prefix())
    group = tiny_llama.num_q_heads // tiny_llama.num_kv_heads
    assert queries[0].shape == (2, group * (40 + 2 + 2), 16)
    capped = QueryCollector(tiny_llama, spec, plan, cap=10).run(spec.kv.exact_prefix())
    assert capped[1].shape == (2, 10, 16)
    with pytest.raises(ValueError, match="cap"):
        QueryCollector(tiny_llama, spec, plan, cap=0)


def test_a_weight_counts_a_continuations_rows_as_if_it_ran_that_many_times(tiny_llama):
    """``weights=[1, 3]`` records each row once and weighs the second continuation's rows 3;
    compacting with them gives what running that continuation three times gives (on-policy
    layers included; the global ranking by plain max), and a capped layer keeps its rows'
    weights."""
    spec = _spec(tiny_llama)
    conts = [[1, 2, 3, 4], [5, 6, 7]]
    group = tiny_llama.num_q_heads // tiny_llama.num_kv_heads
    weighted = QueryCollector(
        tiny_llama, spec, QueryPlan(conts, [1, 0], weights=[1, 3])
    )
    plain = QueryCollector(tiny_llama, spec, QueryPlan(conts, [1, 0]))
    for a, b in zip(
        weighted.run(spec.kv.exact_prefix()), plain.run(spec.kv.exact_prefix())
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert plain.weights(0) is None
    assert weighted.weights(2).tolist() == ([1.0] * 3 + [3.0] * 3) * group
    with_prefix = QueryCollector(
        tiny_llama, spec, QueryPlan(conts, [1, 0], prefix_queries=True, weights=[1, 3])
    )
    assert (
        with_prefix.weights(0).tolist()
        == [1.0] * (group * spec.length) + ([1.0] * 3 + [3.0] * 3) * group
    )
    capped = QueryCollector(
        tiny_llama, spec, QueryPlan(conts, [1, 0], weights=[1, 3]), cap=5
    )
    rows = capped.run(spec.kv.exact_prefix())[1]
    full = weighted.run(spec.kv.exact_prefix())[1]
    keep = [int((full[0] == row).all(-1).nonzero()[0]) for row in rows[0]]
    assert capped.weights(1).tolist() == weighted.weights(1)[keep].tolist()

    # The same rows in another order set the rounding noise (an ill-conditioned value fit
    # amplifies it): the weighted fit must be as close to the repeated one as that.
    long = [list(range(1, 25)), list(range(30, 50))]
    plans = (
        QueryPlan(long, [0, 0], weights=[1, 3]),
        QueryPlan([long[0]] + [long[1]] * 3, [0] * 4),
        QueryPlan([long[1]] * 3 + [long[0]], [0] * 4),
    )
    # on-policy: later layers' queries see the earlier layers compacted. The global ranking
    # takes the plain max: a repeated row leaves a max unchanged, while the default weighted
    # max counts a weight there too (tests/test_pipeline.py checks that ranking)
    ours, theirs, reordered = (
        compact_prepared(
            PreparedPrefix(
                tiny_llama,
                spec,
                "repeat-prefill",
                QueryCollector(tiny_llama, spec, plan),
                {},
            ),
            ratio=0.1,
            method="am-highest-attn-fast",
            score_aggregation="max",
        ).layers
        for plan in plans
    )
    for a, b, c in zip(ours, theirs, reordered):
        assert torch.equal(a.indices, b.indices) and torch.equal(b.indices, c.indices)
        for field in ("beta", "values"):
            noise = (getattr(b, field) - getattr(c, field)).abs().max()
            assert (
                getattr(a, field) - getattr(b, field)
            ).abs().max() <= 2 * noise + 1e-4
    # a max: weights change nothing
    scored = weighted.run_scored(spec.kv.exact_prefix())[1]
    for a, b in zip(scored, plain.run_scored(spec.kv.exact_prefix())[1]):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="weights"):
        QueryPlan(conts, [0, 0], weights=[1, 0])
    with pytest.raises(ValueError, match="context-prefill"):
        QueryPlan(prefix_queries=True).weighted(2)


def test_probe_scores_are_weights_of_the_full_softmax_of_each_probe(tiny_llama):
    """``run_scored``: every prefix key's largest weight, over the recorded rows of the packed
    probes, in the softmax each probe row has when it runs alone after the whole prefix."""
    spec = _spec(tiny_llama)
    continuations, record_from = [[1, 2, 3, 4], [5, 6, 7]], [2, 0]
    plan = QueryPlan(
        continuations=continuations, record_from=record_from, prefix_queries=True
    )
    queries, scores = QueryCollector(tiny_llama, spec, plan).run_scored(
        spec.kv.exact_prefix()
    )
    assert len(queries) == len(scores) == tiny_llama.num_layers
    group = tiny_llama.num_q_heads // tiny_llama.num_kv_heads
    t = spec.length
    for layer in range(tiny_llama.num_layers):
        expected = torch.zeros(tiny_llama.num_kv_heads, t)
        for cont, start in zip(continuations, record_from):
            full = tiny_llama.prefill(IDS + cont)
            keys, q = full.keys[layer].float(), full.queries[layer].float()
            length = t + len(cont)
            q = q.reshape(q.shape[0], group, length, -1)
            for row in range(t + start, length):
                logits = torch.einsum("hgd,hsd->hgs", q[:, :, row], keys[:, : row + 1])
                weights = torch.softmax(
                    logits * tiny_llama.layer_scales()[layer], dim=-1
                )[..., :t]
                expected = torch.maximum(expected, weights.amax(dim=1))
        torch.testing.assert_close(scores[layer], expected, rtol=1e-4, atol=1e-6)
    # the plan's static queries stay out of the probe scores, and are exposed uncapped
    assert (
        QueryCollector(tiny_llama, spec, plan, cap=5).static_queries(0).shape[1]
        == group * t
    )
    no_probe = QueryCollector(
        tiny_llama, spec, QueryPlan(prefix_queries=True)
    ).run_scored(spec.kv.exact_prefix())
    assert no_probe[1] == [None] * tiny_llama.num_layers


def test_random_vectors_match_query_norms(tiny_llama):
    spec = _spec(tiny_llama)
    q = QueryCollector(tiny_llama, spec, QueryPlan(random_vectors=64)).run(
        spec.kv.exact_prefix()
    )
    real = spec.kv.queries[1].norm(dim=-1).mean(-1)
    torch.testing.assert_close(q[1].norm(dim=-1).mean(-1), real, rtol=1e-4, atol=1e-5)


def test_on_policy_layers_see_earlier_compaction(tiny_llama):
    spec = _spec(tiny_llama)
    plan = QueryPlan(continuations=[[9, 8, 7, 6, 5]], record_from=[0])
    collector = QueryCollector(tiny_llama, spec, plan)
    off = collector.run(spec.kv.exact_prefix())
    half = [None] * tiny_llama.num_layers

    def drop_half(layer, queries):
        p = spec.kv.exact_prefix()[layer]
        keep = slice(0, 20)
        half[layer] = True
        return type(p)(
            p.keys[:, keep], p.values[:, keep], p.bias[:, keep], p.positions[:, keep]
        )

    on = collector.run(spec.kv.exact_prefix(), on_layer=drop_half)
    torch.testing.assert_close(on[0], off[0])  # layer 0 sees no compaction before it
    assert not torch.allclose(on[2], off[2])  # later layers do
    assert all(half)


def test_parse_sources_mixture_and_errors():
    names = [s.name for s in parse_sources("self-study+repeat-prefill+quote-prefill")]
    assert names == ["self-study", "repeat-prefill", "quote-prefill"]
    with pytest.raises(ValueError, match="unknown query source"):
        parse_sources("repeat-prefill+telepathy")
    weighted = parse_sources("repeat-prefill+surprise-quote*4")
    assert [s.name for s in weighted] == [
        "repeat-prefill",
        "surprise-quote*4",
    ] and weighted[1].weight == 4
    assert parse_sources("surprise-quote*1")[0].name == "surprise-quote"
    # one probe per 80 tokens, weighted 4
    spaced = parse_sources("repeat-prefill+surprise-quote/80*4")[1]
    assert spaced.weight == 4 and spaced.source.tokens_per_span == 80
    assert parse_sources("surprise-quote/80")[0].tokens_per_span == 80
    assert (
        parse_sources("surprise-quote")[0].tokens_per_span
        == SurpriseQuote().tokens_per_span
    )
    for bad in (
        "surprise-quote/0",
        "surprise-quote/",
        "surprise-quote/x*4",
        "surprise-quote/-3",
        "surprise-quote/Auto",
        "surprise-quote/15",
    ):  # closer than a probe's span of 16 tokens
        with pytest.raises(ValueError, match="spacing is a whole number"):
            parse_sources(bad)
    for unspaced in (
        "repeat-prefill/80",
        "surprise-quote+context-prefill/50",
        "repeat-prefill/auto",
    ):
        with pytest.raises(ValueError, match="sources that probe spans"):
            parse_sources(unspaced)
    for bad in (
        "surprise-quote*0",
        "surprise-quote*",
        "surprise-quote*two",
        "surprise-quote*17",
    ):
        with pytest.raises(ValueError, match="weight is an integer"):
            parse_sources(bad)
    # refused when parsed
    for static in (
        "context-prefill*2",
        "repeat-prefill+random-vectors*3",
    ):
        with pytest.raises(ValueError, match="sources that run probes"):
            parse_sources(static)


def test_auto_spacing_follows_the_ratio():
    # about 4 slots per head for each probe, between the two measured spacings (80 and 160)
    assert [auto_spacing(r) for r in (1.0, 0.1, 0.05, 0.03, 0.025, 0.02, 0.01)] == [
        80,
        80,
        80,
        133,
        160,
        160,
        160,
    ]
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="ratio must be in"):
            auto_spacing(bad)
    assert (
        resolve_spacing("repeat-prefill+surprise-quote/auto*4", 0.1)
        == "repeat-prefill+surprise-quote/80*4"
    )
    assert (
        resolve_spacing("surprise-quote/auto+repeat-prefill", 0.02)
        == "surprise-quote/160+repeat-prefill"
    )
    for unchanged in ("repeat-prefill+surprise-quote/80*4", "repeat-prefill"):
        assert resolve_spacing(unchanged, 0.02) == unchanged
    # a prepared prefix is planned for one spacing: '/auto' is resolved for a ratio first
    with pytest.raises(ValueError, match="takes the spacing from the compaction ratio"):
        parse_sources("repeat-prefill+surprise-quote/auto*4")
    assert (
        parse_sources(resolve_spacing("surprise-quote/auto*4", 0.05))[
            0
        ].source.tokens_per_span
        == 80
    )


@pytest.mark.slow
def test_real_auto_spacing_is_resolved_by_compact(smollm2):
    """``compact`` plans '/auto' probes for its own ratio (or target_tokens): the cache is the
    one the explicit spacing gives, and records the spacing it used."""
    prompt = needle_prompt(smollm2, make_needle(smollm2.tokenizer, 600, seed=3))
    ids, mask = prompt.prefix_ids, prompt.compact_mask
    content = int(mask.sum())

    def run(queries, **budget):
        return compact_prefix(
            smollm2, ids, mask, method="kvzip", queries=queries, **budget
        )

    auto, dense = (
        run("surprise-quote/auto", ratio=0.1),
        run("surprise-quote/80", ratio=0.1),
    )
    assert auto.query_source == "surprise-quote/80"
    assert all(
        torch.equal(a.indices, b.indices) for a, b in zip(auto.layers, dense.layers)
    )
    assert run("surprise-quote/auto", ratio=0.02).query_source == "surprise-quote/160"
    # a ratio between the two spacings: 4 / ratio tokens per probe
    target = round(0.03 * content)
    assert 80 < auto_spacing(target / content) < 160
    assert (
        run("surprise-quote/auto", target_tokens=target).query_source
        == f"surprise-quote/{auto_spacing(target / content)}"
    )


@pytest.mark.slow
def test_real_repeat_prefill_and_self_study_plans(smollm2):
    text = "Ada Lovelace wrote the first published algorithm for Babbage's Analytical Engine in 1843."
    ids, mask = smollm2.chat_content([{"role": "user", "content": text}])
    spec = PrefixSpec(torch.tensor(ids), mask, smollm2.prefill(ids))
    repeat = parse_sources("repeat-prefill")[0].plan(smollm2, spec)
    decoded = smollm2.tokenizer.decode(repeat.continuations[0])
    assert REPEAT_INSTRUCTION in decoded and decoded.rstrip().endswith(text)
    study = SelfStudy(max_new_tokens=12).plan(smollm2, spec)
    assert len(study.continuations) >= 4 and all(
        len(c) > 12 for c in study.continuations
    )


@pytest.mark.slow
def test_real_repeat_chat_repeats_the_messages_with_their_role_headers(smollm2):
    """``repeat-chat`` repeats the prefix from the first message's content to the last one's,
    template tokens between them included; ``repeat-prefill`` repeats the contents alone."""
    messages = [
        {"role": "user", "content": "My sister's name is Ambrose."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "And I live in Oslo."},
    ]
    ids, mask = smollm2.chat_content(messages)
    spec = PrefixSpec(torch.tensor(ids), mask, smollm2.prefill(ids))
    chat = parse_sources("repeat-chat")[0].plan(smollm2, spec).continuations[0]
    plain = parse_sources("repeat-prefill")[0].plan(smollm2, spec).continuations[0]
    first, last = mask.nonzero().flatten()[[0, -1]].tolist()
    assert chat[-(last + 1 - first) :] == ids[first : last + 1]
    content = [t for t, m in zip(ids, mask.tolist()) if m]
    assert plain[-len(content) :] == content
    # the same instruction turn before either repeat
    assert chat[: -(last + 1 - first)] == plain[: -len(content)]
    assert "<|im_start|>assistant\nNoted." in smollm2.tokenizer.decode(chat)


def test_quote_prefill_refuses_empty_windows():
    for bad in ({"window": 0}, {"lead": 0}):
        with pytest.raises(ValueError, match="window >= 1 and lead >= 1"):
            QuotePrefill(**bad)


@pytest.mark.slow
def test_real_quote_prefill_answers_every_token_after_the_first_lead_once(smollm2):
    text = (
        "Ada Lovelace wrote the first published algorithm.\nIt was for Babbage's Analytical Engine, "
        "in 1843, and it computed Bernoulli numbers. The engine was never built."
    )
    ids, mask = smollm2.chat_content([{"role": "user", "content": text}])
    spec = PrefixSpec(torch.tensor(ids), mask, smollm2.prefill(ids))
    source = QuotePrefill(window=7, lead=3)
    plan = source.plan(smollm2, spec)
    content = spec.content_ids
    assert len(plan.continuations) == -(
        -(len(content) - 3) // 7
    ) and plan.record_from == [0] * len(plan.continuations)
    answered = []
    for i, cont in enumerate(plan.continuations):
        lead = " ".join(smollm2.tokenizer.decode(content[7 * i : 7 * i + 3]).split())
        turn = smollm2.turn_ids(
            [{"role": "user", "content": source.instruction.format(lead=lead)}]
        )
        # a one-line quote of the window's lead, then the answer
        assert cont[: len(turn)] == turn
        answered += cont[len(turn) :]
    assert answered == content[3:]


def test_surprising_spans_pick_the_highest_sums_without_overlap():
    surprisal = torch.zeros(40)
    surprisal[10:14] = 5.0  # the most surprising span
    surprisal[30] = 3.0
    surprisal[12] = 6.0
    assert surprising_spans(surprisal, 4, 1) == [10]
    starts = surprising_spans(surprisal, 4, 3)
    assert len(starts) == 3 and 10 in starts and any(s <= 30 < s + 4 for s in starts)
    assert all(b - a >= 4 for a, b in zip(starts, starts[1:]))  # ascending, no overlap
    assert surprising_spans(surprisal, 100, 5) == [0]  # one span covers a short content


def test_surprise_quote_refuses_bad_sizes():
    for bad in (
        {"span": 0},
        {"window": 0},
        {"margin": -1},
        {"spans": 0},
        {"tokens_per_span": 0},
        {"only_names": True},
    ):
        with pytest.raises(ValueError, match="surprise-quote needs"):
            SurpriseQuote(**bad)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma3"])
def test_token_surprisal_matches_the_logits_of_a_forward_pass(model, request):
    adapter = request.getfixturevalue(model)
    ids = IDS[:30]
    nll = adapter.token_surprisal(ids, chunk=7)
    logits = adapter.forward(
        ids, torch.arange(len(ids)), logits_to_keep=len(ids)
    ).logits
    expected = -torch.log_softmax(logits[:-1], -1).gather(
        1, torch.tensor(ids[1:])[:, None]
    )[:, 0]
    assert nll[0] == 0
    torch.testing.assert_close(nll[1:], expected, rtol=1e-5, atol=1e-5)
    # from the prefill's hidden states (what surprise-quote uses), without another decoder pass
    torch.testing.assert_close(
        adapter.token_surprisal(ids, hidden=adapter.prefill(ids).last_hidden), nll
    )


@pytest.mark.slow
def test_a_prefix_computes_its_surprisal_once_for_every_surprise_source(
    smollm2, monkeypatch
):
    """The default's mixture plans two surprise sources on one prefix (a chat with a name said
    in passing): the vocabulary projection runs once, and each source plans what it plans on
    a prefix of its own."""
    _, spec = _task_spec(smollm2, "chat-facts", 8)
    calls = []
    surprisal = smollm2.token_surprisal
    monkeypatch.setattr(
        smollm2,
        "token_surprisal",
        lambda *args, **kwargs: calls.append(1) or surprisal(*args, **kwargs),
    )
    sources = parse_sources("surprise-number-quote/80+surprise-name-quote/80")
    shared = [source.plan(smollm2, spec).continuations for source in sources]
    assert len(calls) == 1 and all(shared)
    torch.testing.assert_close(
        spec.content_surprisal(smollm2),
        surprisal(spec.token_ids, hidden=spec.kv.last_hidden).cpu()[spec.compact_mask],
    )
    fresh = [dataclasses.replace(spec) for _ in sources]
    alone = [source.plan(smollm2, f).continuations for source, f in zip(sources, fresh)]
    assert shared == alone and len(calls) == 3


@pytest.mark.slow
def test_real_surprise_quote_probes_the_needle(smollm2):
    """The 7 random digits of a needle are among the most surprising spans of an essay: one of
    the probes quotes the needle's value in answer mode."""
    inst = make_needle(smollm2.tokenizer, 2000, seed=19)
    prompt = needle_prompt(smollm2, inst)
    spec = PrefixSpec(torch.tensor(prompt.prefix_ids), prompt.compact_mask, None)
    source = SurpriseQuote()
    plan = source.plan(smollm2, spec)
    content = spec.content_ids
    assert len(plan.continuations) == round(len(content) / source.tokens_per_span)
    turns = [smollm2.tokenizer.decode(c) for c in plan.continuations]
    assert all(t.count(source.instruction.split('"')[0]) == 1 for t in turns)
    # answered, not only quoted
    assert any(inst.value in t.split("assistant")[-1] for t in turns)
    # '/80' probes twice as densely, and the greedy span choice keeps every sparser probe
    dense = parse_sources("surprise-quote/80")[0].plan(smollm2, spec).continuations
    assert len(dense) == round(len(content) / 80) > len(plan.continuations)
    assert {tuple(c) for c in plan.continuations} <= {tuple(c) for c in dense}


def test_number_starts_finds_each_word_with_two_digits_at_its_first_token():
    # tokens joined by "|": a code then a stop (3), a time (11), one digit (not a number), a line
    # number (19), a file name's digits (23), a key whose first digit comes later (28)
    joined = (
        "The| code| is| 4|8|5|5|3|8|.| At| 1|2|:|3|0| v|2| line| 4|1|2| in| run|_|0|7|.log"
        "| AB|1|C|-|D|2|EF"
    )
    pieces = joined.split("|")
    assert number_starts(pieces) == [3, 11, 19, 23, 28]
    assert number_starts(["no", " digits", " here", " 7"]) == []


@pytest.mark.slow
def test_real_surprise_number_quote_adds_a_probe_for_each_number_the_spans_miss(
    smollm2,
):
    """On an agent trace (numbers in predictable tool lines), the numbers' probes come after the
    span probes, which they leave unchanged, and between them every number is quoted."""
    inst, spec = _task_spec(smollm2, "agent-trace", seed=3)
    spans = SurpriseQuote().plan(smollm2, spec).continuations
    source = SurpriseNumberQuote()
    plan = source.plan(smollm2, spec).continuations
    assert plan[: len(spans)] == spans and plan[len(spans) :]
    assert len(plan) - len(spans) <= len(spans)  # at most as many as the spans
    assert parse_sources("surprise-number-quote/80*4")[0].source.numbers
    content = spec.content_ids
    window = source.window
    # where in the content each probe's teacher-forced answer comes from
    starts = [
        next(s for s in range(len(content)) if content[s : s + window] == c[-window:])
        for c in plan
    ]
    quoted = {at for s in starts for at in range(s, s + window)}
    numbers = number_starts(token_pieces(smollm2.tokenizer, content))
    # every number is quoted, unless the limit (as many as the spans) binds
    missed = [at for at in numbers if at not in quoted]
    assert not missed or len(plan) == 2 * len(spans)
    # each added probe starts a margin before a number the span probes did not quote
    span_quoted = {at for s in starts[: len(spans)] for at in range(s, s + window)}
    for s in starts[len(spans) :]:
        assert s + source.margin in numbers and s + source.margin not in span_quoted
    # the asked number is among the quoted ones
    assert any(
        a in smollm2.tokenizer.decode(c[-window:]) for c in plan for a in inst.answers
    )


def test_name_starts_finds_capitalised_words_inside_sentences_only():
    # tokens joined by "|": a sentence's first word (no), "I" (no), a name after "is" (5), a word
    # after a full stop (no), a three-word company after "at" (11), a name after a comma and a
    # line break (17), a hyphenated name after "to" (25)
    joined = (
        "The| sister| I| know| is| Thad|deus|.| We| met| at| Gran|ite| Peak| Software| ok|,\n"
        "|Ljub|ljana| said|.| Then| we| went| to| Jean|-|Luc|."
    )
    assert name_starts(joined.split("|")) == [5, 11, 17, 25]
    assert name_starts(["All", " lower", " case", " here", "."]) == []


@pytest.mark.slow
def test_real_surprise_entity_quote_probes_the_name_said_in_passing(smollm2):
    """A sister's name said once inside a long chat turn ranks below the essay's dense windows and
    no span or number probe quotes it; the entity source adds a probe that answers with it, after
    the number source's probes, which it leaves unchanged."""
    inst, spec = _task_spec(smollm2, "chat-facts", seed=8)
    source = parse_sources("surprise-entity-quote/80")[0]
    assert isinstance(source, SurpriseEntityQuote) and source.numbers and source.names
    numbers = parse_sources("surprise-number-quote/80")[0].plan(smollm2, spec)
    plan = source.plan(smollm2, spec).continuations
    assert plan[: len(numbers.continuations)] == numbers.continuations

    def answered(continuations):
        return [
            c
            for c in continuations
            if any(
                a in smollm2.tokenizer.decode(c[-source.window :]) for a in inst.answers
            )
        ]

    assert not answered(numbers.continuations) and answered(plan)
    spans = len(SurpriseQuote(tokens_per_span=80).plan(smollm2, spec).continuations)
    # at most as many name probes as the spans
    assert len(plan) - len(numbers.continuations) <= spans
    # the names-only source runs exactly those name probes, so a spec can weigh them apart
    names_only = parse_sources("surprise-name-quote/80")[0]
    assert isinstance(names_only, SurpriseNameQuote)
    names = names_only.plan(smollm2, spec).continuations
    assert names == plan[len(numbers.continuations) :] and answered(names)


def test_number_and_name_words_cover_every_token_of_the_word():
    joined = (
        "My| code| is| 4|8|5|5|3|8|,| ask| Gran|ite| Peak| Software| at| 1|2|:|3|0|."
    )
    pieces = joined.split("|")
    assert number_words(pieces) == [range(3, 9), range(16, 21)]
    assert name_words(pieces) == [range(11, 15)]


@pytest.mark.parametrize("source", [SurpriseCloze, SurpriseRecap])
def test_sentence_probes_refuse_bad_sizes(source):
    for bad in ({"lead": 0}, {"tail": 0}, {"tokens_per_span": 0}, {"spans": 0}):
        with pytest.raises(ValueError, match=f"{source.name} needs"):
            source(**bad)


@pytest.mark.slow
def test_real_surprise_cloze_asks_for_each_word_with_its_sentence_blanked(smollm2):
    """On a chat with a sister's name said in passing, one probe asks for the name with the rest
    of its sentence shown and answers with it; every probe blanks one name or number and answers
    with that word's own tokens and the rest of its sentence, taken from the content."""
    inst, spec = _task_spec(smollm2, "chat-facts", seed=8)
    source = parse_sources("surprise-cloze/80*4")[0]
    assert source.weight == 4 and isinstance(source.source, SurpriseCloze)
    plan = source.plan(smollm2, spec)
    assert set(plan.weights) == {4}
    tokenizer = smollm2.tokenizer
    content = spec.content_ids
    pieces = token_pieces(tokenizer, content)
    words = {w.start: w for w in number_words(pieces) + name_words(pieces)}
    count = round(len(content) / 80)
    assert 0 < len(plan.continuations) <= 2 * count
    for continuation in plan.continuations:
        assert tokenizer.decode(continuation).count(BLANK) == 1
        # the answer: a blanked word, whole, then at most `tail` tokens of its sentence
        assert any(
            continuation[start - stop :] == content[start:stop]
            for start, word in words.items()
            for stop in range(word.stop, word.stop + source.source.tail + 1)
        )
    asked = [
        tokenizer.decode(c)
        for c in plan.continuations
        if "sister's name is ___." in tokenizer.decode(c)
    ]
    assert len(asked) == 1 and asked[0].endswith(f" {inst.answers[0]}.")


def test_second_person_turns_first_person_words_and_keeps_the_rest():
    assert second_person("Oh, and my sister's name is Ambrose.") == (
        "Oh, and your sister's name is Ambrose."
    )
    # a sentence's first word keeps its capital; contractions turn whole
    assert second_person("I moved to Oslo. I'm happy, my friends say.") == (
        "You moved to Oslo. You're happy, your friends say."
    )
    # words that only contain a first-person word stay: "Mine" in "Minecraft", "us" in "bus"
    assert second_person("Minecraft by bus, Iowa, myriad, I'dx") == (
        "Minecraft by bus, Iowa, myriad, I'dx"
    )
    assert second_person("The door code is 481736.") == "The door code is 481736."


@pytest.mark.slow
def test_real_surprise_recap_restates_the_fact_in_the_second_person(smollm2):
    """On a chat with a sister's name said in passing, one probe restates the sentence as the
    assistant would answer ("your sister's name is ..."); every probe answers the fixed question
    with one sentence, and two words of one sentence make one probe."""
    inst, spec = _task_spec(smollm2, "chat-facts", seed=8)
    source = parse_sources("surprise-recap/80")[0]
    assert isinstance(source, SurpriseRecap)
    plan = source.plan(smollm2, spec)
    tokenizer = smollm2.tokenizer
    texts = [tokenizer.decode(c) for c in plan.continuations]
    count = round(len(spec.content_ids) / 80)
    assert 0 < len(texts) <= 2 * count and len(set(texts)) == len(texts)
    assert all(RECAP_QUESTION in text for text in texts)
    restated = [t for t in texts if f"your sister's name is {inst.answers[0]}." in t]
    assert len(restated) == 1 and "my sister" not in restated[0]
