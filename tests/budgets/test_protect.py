"""Protected spans: identifier tokens skip the fit and stay exact in every head, at the budget's
expense, so the prefix keeps its size."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am.selectors.base import PRIORITY_SHARE
from vllm_compaction.budgets.protect import (
    LEAD_TOKENS,
    MAX_PROTECTED_SHARE,
    SINK_TOKENS,
    check_priority_exact_depth,
    depth_band,
    identifier_shape,
    identifier_spans,
    lead_spans,
    protected_tokens,
    ranked_template,
    singular_tokens,
    span_ids,
)
from vllm_compaction.pipeline import compact
from vllm_compaction.recipes import resolve

IDENTIFIERS = ("524533559245", "AB1C-D2EF-GH3I", "531-354-7468", "a3f9c2e1b7d4")


def _spelled(pieces: list[str], spans: list[list[int]]) -> list[str]:
    return ["".join(pieces[i] for i in span).strip() for span in spans]


def test_identifier_spans_are_words_with_digits_of_six_characters_or_more():
    pieces = ["In", " 2", "0", "0", "5", " I", " moved", " to", " Krak", "ow", "; "]
    pieces += [
        "my",
        " key",
        " is",
        " AB",
        "1",
        "C",
        "-",
        "D",
        "2",
        "EF",
        "-",
        "GH",
        "3",
        "I",
        ".",
    ]
    pieces += [
        " Call",
        " 5",
        "3",
        "1",
        "-",
        "3",
        "5",
        "4",
        "-",
        "7",
        "4",
        "6",
        "8",
        " or",
        " mp",
        "3",
    ]
    assert _spelled(pieces, identifier_spans(pieces)) == [
        "AB1C-D2EF-GH3I",
        "531-354-7468",
    ]


def test_the_tokens_of_each_identifier_are_protected_and_nothing_else(smollm2):
    text = " ".join(
        f"Note {i}: the value is {value}, written in 2005 by a friend in Krakow."
        for i, value in enumerate(IDENTIFIERS)
    )
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    content = torch.ones(len(ids), dtype=torch.bool)
    mask = protected_tokens(
        ids, smollm2.tokenizer, "identifiers", content, slots=len(ids)
    )
    runs, run = [], []
    for i, keep in enumerate(mask.tolist()):
        if keep:
            run.append(ids[i])
        elif run:
            runs.append(smollm2.tokenizer.decode(run).strip())
            run = []
    assert runs == list(IDENTIFIERS)
    # template tokens are never protected; "none" protects nothing
    content[: len(ids) // 2] = False
    half = protected_tokens(ids, smollm2.tokenizer, "identifiers", content, len(ids))
    assert not half[: len(ids) // 2].any() and half.sum() < mask.sum()
    assert not protected_tokens(ids, smollm2.tokenizer, "none", content, len(ids)).any()
    # at most MAX_PROTECTED_SHARE of the slots, the longest identifiers first
    few = protected_tokens(
        ids, smollm2.tokenizer, "identifiers", torch.ones_like(content), 30
    )
    assert 0 < few.sum() <= MAX_PROTECTED_SHARE * 30


def _kept_text(smollm2, text: str, rule: str, slots: int) -> str:
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    content = torch.ones(len(ids), dtype=torch.bool)
    mask = protected_tokens(ids, smollm2.tokenizer, rule, content, slots)
    return smollm2.tokenizer.decode([i for i, keep in zip(ids, mask.tolist()) if keep])


def test_phrases_keep_the_key_an_identifier_belongs_to_within_its_sentence(smollm2):
    text = (
        "We talked about gardens. The door code for the back door is 481736. "
        "The door code for the side door is 481763. Then we had lunch."
    )
    assert _kept_text(smollm2, text, "identifiers", 100) == "481736481763"
    assert _kept_text(smollm2, text, "identifier-phrases", 100) == (
        " The door code for the back door is 481736"
        " The door code for the side door is 481763"
    )
    # identifiers take the room first: with room for both numbers and one phrase, the first
    # phrase is kept whole and the second not at all
    phrase = len(smollm2.tokenizer(" The door code for the back door is ")["input_ids"])
    assert (
        _kept_text(smollm2, text, "identifier-phrases", 2 * (12 + phrase))
        == " The door code for the back door is 481736481763"
    )


def test_names_inside_a_sentence_are_protected_after_the_identifiers(smollm2):
    text = (
        "We talked about gardens. Oh, and my sister's name is Rosalind. "
        "Last year I moved to Ljubljana, near my key 481736. Then we had lunch."
    )
    assert _kept_text(smollm2, text, "identifiers", 100) == "481736"
    # a sentence's first word ("We", "Oh", "Last", "Then") and "I" are not names
    assert _kept_text(smollm2, text, "identifiers-names", 100) == (
        " Rosalind Ljubljana481736"
    )
    # the identifiers take the room first
    digits = len(smollm2.tokenizer("481736")["input_ids"])
    assert _kept_text(smollm2, text, "identifiers-names", 2 * digits) == "481736"


def test_names_are_found_in_the_content_alone_not_after_a_role_header(smollm2):
    # a turn's first word follows its role header's line break ("user\n"): a sentence's first
    # word, not a name, once the header is outside the content
    header = smollm2.tokenizer("<|im_start|>user\n", add_special_tokens=False)[
        "input_ids"
    ]
    turn = smollm2.tokenizer(
        "Thanks for that. My sister's name is Rosalind.", add_special_tokens=False
    )["input_ids"]
    ids = header + turn
    content = torch.tensor([False] * len(header) + [True] * len(turn))
    for find in (
        lambda: protected_tokens(
            ids, smollm2.tokenizer, "identifiers-names", content, None
        ),
        lambda: singular_tokens(ids, smollm2.tokenizer, content),
    ):
        mask = find()
        assert smollm2.tokenizer.decode(
            [i for i, m in zip(ids, mask.tolist()) if m]
        ) == (" Rosalind")


def test_facts_are_short_numbers_and_names_said_at_most_twice_after_the_identifiers(
    smollm2,
):
    text = (
        "We read about Lisp. The vault code is 7319, and we meet in room 42 with Rosalind. "
        "Got it: the code is 7319. My account is 524533559245. Lisp is old, Lisp is good, "
        "and Lisp is fast. In v2 we moved to Ljubljana."
    )
    # "Lisp" (four times) is the text's subject, "v2" has one digit, the sentences' first words
    # are not names; the code said twice (a reply repeating it) is still a fact
    assert _kept_text(smollm2, text, "identifiers-facts", 100) == (
        "731942 Rosalind7319524533559245 Ljubljana"
    )
    digits = len(smollm2.tokenizer("524533559245")["input_ids"])
    assert _kept_text(smollm2, text, "identifiers-facts", 2 * digits) == "524533559245"
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    content = torch.ones(len(ids), dtype=torch.bool)
    facts = protected_tokens(ids, smollm2.tokenizer, "identifiers-facts", content, None)
    identifiers = protected_tokens(ids, smollm2.tokenizer, "identifiers", content, None)
    # the facts are singular (floor_on=singular raises them) and add to the identifiers
    assert (identifiers <= facts).all()
    assert (
        facts & ~identifiers <= singular_tokens(ids, smollm2.tokenizer, content)
    ).all()


def test_a_phrase_stops_at_a_line_another_identifier_a_template_token_or_its_length():
    pieces = ["ok", ".", " The", " code", " is", " 4", "8", "1", "7", "3", "6"]
    spans = identifier_spans(pieces)
    assert lead_spans(pieces, spans, [True] * len(pieces)) == [[2, 3, 4]]
    allowed = [True] * len(pieces)
    allowed[3] = False  # a chat-template token
    assert lead_spans(pieces, spans, allowed) == [[4]]
    lines = [
        "commit",
        " a",
        "3",
        "f",
        "9",
        "c",
        "2",
        "\n",
        "commit",
        " 9",
        "f",
        "8",
        "e",
        "7",
        "d",
    ]
    assert lead_spans(lines, identifier_spans(lines), [True] * len(lines)) == [[0], [8]]
    adjacent = ["x", " 1", "2", "3", "4", "5", "6", " 6", "5", "4", "3", "2", "1"]
    assert lead_spans(adjacent, identifier_spans(adjacent), [True] * 13)[1] == []
    words = [" word"] * (LEAD_TOKENS + 5) + [" 1", "2", "3", "4", "5", "6"]
    (lead,) = lead_spans(words, identifier_spans(words), [True] * len(words))
    assert lead == list(range(5, LEAD_TOKENS + 5))


def test_span_ids_number_the_runs_of_protected_tokens():
    mask = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert span_ids(mask).tolist() == [0, 0, -1, -1, 1, -1, 2, 2, 2]
    assert span_ids(torch.zeros(3, dtype=torch.bool)).tolist() == [-1, -1, -1]
    assert span_ids(torch.zeros(0, dtype=torch.bool)).tolist() == []


def test_without_a_tokenizer_nothing_is_protected_and_a_warning_says_why(caplog):
    content = torch.ones(8, dtype=torch.bool)
    with caplog.at_level("WARNING", logger="vllm_compaction.budgets.protect"):
        mask = protected_tokens(list(range(8)), None, "identifiers", content, 4.0)
    assert not mask.any() and "needs the model's tokenizer" in caplog.text


def test_unknown_rules_are_refused():
    with pytest.raises(ValueError, match="protect must be one of none, identifiers"):
        resolve("am:protect=digits")
    with pytest.raises(ValueError, match="protect_by must be one of exact, selection"):
        resolve("am:protect=identifiers,protect_by=fit")
    # only a selector that ranks keys can keep protected tokens first
    with pytest.raises(ValueError, match="protect_by=selection needs a selector"):
        resolve("kvmerger:protect=identifiers,protect_by=selection")
    assert resolve("kvmerger:protect=identifiers").protect_by == "exact"
    with pytest.raises(ValueError, match="protect_by=whole needs a selector"):
        resolve("random:protect=identifiers,protect_by=whole")
    # OMP keeps them in its first round
    assert resolve(
        "am-omp-fast:protect=identifiers,protect_by=selection"
    ).protect_by == ("selection")
    chosen = resolve("am:protect=identifiers,protect_by=selection")
    assert (chosen.protect, chosen.protect_by) == ("identifiers", "selection")
    assert resolve("am:protect=identifiers,protect_by=whole").protect_by == "whole"
    # the default keeps identifiers first in each head's selection; protect=none turns it off
    default = resolve("am")
    assert (default.protect, default.protect_by) == ("identifiers", "selection")
    assert resolve("am:protect=none").protect == "none"
    assert resolve("am-highest-attn").protect == "none"
    # floor_on picks what priority_beta_floor raises, so it needs one, and protected tokens fitted
    refused = {
        "priority_beta_floor=1,floor_on=once": "floor_on must be one of all, singular",
        "floor_on=singular": "floor_on=singular picks the kept protected",
        "protect=none,priority_beta_floor=1,floor_on=singular": "picks the kept protected",
    }
    for overrides, message in refused.items():
        with pytest.raises(ValueError, match=message):
            resolve(f"am:{overrides}")
    assert resolve("am").floor_on == "all"
    assert resolve("am:priority_beta_floor=1,floor_on=singular").floor_on == "singular"


def test_protected_tokens_stay_exact_in_every_head_or_first_in_each_selection(
    smollm2,
):
    messages = [
        {
            "role": "user",
            "content": "I keep notes on my accounts here. " * 6
            + "For the record, my account number is 524533559245. "
            + "The rest of this message is about the weather and the garden. " * 6,
        }
    ]
    common = dict(ratio=0.2, queries="context-prefill", on_policy=False)
    plain = compact(smollm2, messages, method="am-highest-attn", **common)
    kept = compact(
        smollm2, messages, method="am-highest-attn:protect=identifiers", **common
    )
    protected = kept.options["protected_tokens"]
    assert protected >= 6 and plain.options["protected_tokens"] == 0
    # the compacted span is the content's, protected tokens in it or not
    assert kept.compacted_span == plain.compacted_span
    # the protected slots come out of the budget: the same size, up to rounding per head
    heads = sum(layer.num_heads for layer in kept.layers)
    assert abs(kept.physical_slots - plain.physical_slots) <= heads
    ids = kept.token_ids
    number = smollm2.tokenizer("524533559245", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(ids)) if ids[i : i + len(number)] == number)
    positions = torch.arange(start, start + len(number))
    kv = smollm2.prefill(ids, capture_queries=False)
    for layer, compacted in enumerate(kept.layers):
        for h in range(compacted.num_heads):
            keys, beta, _, idx = compacted.head(h)
            at = torch.isin(idx, positions)
            assert int(at.sum()) == len(number), (layer, h)
            assert not beta[at].any()
            torch.testing.assert_close(keys[at], kv.keys[layer][h, idx[at]])
    # by selection: the same budgets as without protection, and each head keeps as many of
    # the number's tokens as half its content slots hold, where the plain selection drops most
    chosen = compact(
        smollm2,
        messages,
        method="am-highest-attn:protect=identifiers,protect_by=selection",
        **common,
    )
    assert chosen.options["protected_tokens"] == protected
    assert chosen.physical_slots == plain.physical_slots
    template = int((~smollm2.chat_content(messages)[1]).sum())
    kept_by_selection = kept_by_plain = 0
    for selected, unprotected in zip(chosen.layers, plain.layers, strict=True):
        for h in range(selected.num_heads):
            idx = selected.head(h)[3]
            at = int(torch.isin(idx, positions).sum())
            assert at >= min(len(number), (len(idx) - template) // 2)
            kept_by_selection += at
            kept_by_plain += int(torch.isin(unprotected.head(h)[3], positions).sum())
    assert kept_by_plain < kept_by_selection / 2
    # whole: a head whose half holds the number keeps all of it; any other head selects as
    # without protection
    whole = compact(
        smollm2,
        messages,
        method="am-highest-attn:protect=identifiers,protect_by=whole",
        **common,
    )
    assert whole.physical_slots == plain.physical_slots
    holds = 0
    for selected, unprotected in zip(whole.layers, plain.layers, strict=True):
        for h in range(selected.num_heads):
            idx = selected.head(h)[3]
            if (len(idx) - template) // 2 >= len(number):
                assert int(torch.isin(idx, positions).sum()) == len(number)
                holds += 1
            else:
                assert torch.equal(idx, unprotected.head(h)[3])
    assert holds > 0


def test_a_depth_band_is_the_layers_whose_middle_lies_inside_it():
    band = check_priority_exact_depth("0.56-0.84")
    assert band == (0.56, 0.84)
    # SmolLM2's 30 layers: 17-24, the retrieval heads' band; Gemma-3's 18: 10-14
    assert [i for i, inside in enumerate(depth_band(band, 30)) if inside] == list(
        range(17, 25)
    )
    assert [i for i, inside in enumerate(depth_band(band, 18)) if inside] == list(
        range(10, 15)
    )
    assert all(depth_band((0.0, 1.0), 7)) and depth_band((0.8, 1.0), 4) == [0, 0, 0, 1]
    assert check_priority_exact_depth(None) is None
    assert check_priority_exact_depth("none") is None
    for bad in ("0.8-0.5", "0.5", "a-b", "0.5-1.5", "-0.1-0.5", 0.5):
        with pytest.raises(ValueError, match="priority_exact_depth is a band of depth"):
            check_priority_exact_depth(bad)
    # it keeps the tokens a head's selection keeps first, so it needs them kept by selection
    refused = {
        "am:protect=none,priority_exact_depth=0.5-0.8": "needs protect",
        "am:protect_by=exact,priority_exact_depth=0.5-0.8": "needs protect",
        "am:priority_values=direct,priority_exact_depth=0.5-0.8": "drop priority_values",
        "am:priority_beta_floor=0,priority_exact_depth=0.5-0.8": (
            "priority_exact_depth: .*priority_beta_floor"
        ),
        "am:band_protect=identifiers-names": "give priority_exact_depth too",
        "am:priority_exact_depth=0.5-0.8,band_protect=none": (
            "band_protect=none protects nothing"
        ),
        "am:priority_exact_depth=0.5-0.8,band_protect=digits": "protect must be one of",
    }
    for spec, message in refused.items():
        with pytest.raises(ValueError, match=message):
            resolve(spec)
    chosen = resolve("am:priority_exact_depth=0.5-1")
    assert chosen.band_layers(4) == [False, False, True, True]
    assert chosen.band_protect == chosen.protect == "identifiers"
    assert chosen.band_method is not None
    assert chosen.band_method.fit.priority_values == "exact"
    assert chosen.method.fit.priority_values == "lstsq"
    assert resolve("am").band_layers(3) == [False] * 3
    names = resolve("am:priority_exact_depth=0.5-1,band_protect=identifiers-names")
    assert (names.protect, names.band_protect) == ("identifiers", "identifiers-names")


def test_a_depth_band_keeps_the_kept_protected_tokens_as_they_were_inside_it_only(
    smollm2,
):
    messages = [
        {
            "role": "user",
            "content": "I keep notes on my accounts here. " * 6
            + "For the record, my account number is 524533559245. "
            + "The rest of this message is about the weather and the garden. " * 3
            + "By the way, my sister's name is Rosalind. "
            + "The rest of this message is about the weather and the garden. " * 3,
        }
    ]
    common = dict(ratio=0.2, queries="context-prefill", on_policy=False)
    spec = "am-highest-attn:protect=identifiers,protect_by=selection"
    fitted = compact(smollm2, messages, method=spec, **common)
    banded = compact(
        smollm2, messages, method=f"{spec},priority_exact_depth=0.5-1", **common
    )
    assert banded.options["priority_exact_depth"] == "0.5-1"
    assert fitted.options["priority_exact_depth"] is None
    ids = banded.token_ids
    number = smollm2.tokenizer("524533559245", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(ids)) if ids[i : i + len(number)] == number)
    positions = torch.arange(start, start + len(number))
    kv = smollm2.prefill(ids, capture_queries=False)
    band = depth_band((0.5, 1.0), len(banded.layers))
    fitted_in_band = 0
    for layer, (plain, kept) in enumerate(
        zip(fitted.layers, banded.layers, strict=True)
    ):
        for h in range(kept.num_heads):
            keys, beta, values, idx = kept.head(h)
            plain_keys, plain_beta, plain_values, plain_idx = plain.head(h)
            # the band changes the fit, never which keys are kept
            assert torch.equal(idx, plain_idx), (layer, h)
            if not band[layer]:
                assert torch.equal(beta, plain_beta) and torch.equal(
                    values, plain_values
                )
                continue
            at = torch.isin(idx, positions)
            assert not beta[at].any(), (layer, h)
            torch.testing.assert_close(values[at], kv.values[layer][h, idx[at]])
            fitted_in_band += int(plain_beta[at].ne(0).sum())
    # without the band the same slots were fitted, so the band is what kept them as they were
    assert fitted_in_band > 0
    # band_protect: the band's heads keep the name first too, as it was; the other layers are
    # those of protect=identifiers, slot for slot
    named = compact(
        smollm2,
        messages,
        method=f"{spec},priority_exact_depth=0.5-1,band_protect=identifiers-names",
        **common,
    )
    assert named.options["band_protect"] == "identifiers-names"
    assert named.options["band_protected_tokens"] > banded.options["protected_tokens"]
    name = smollm2.tokenizer(" Rosalind", add_special_tokens=False)["input_ids"]
    at_name = next(i for i in range(len(ids)) if ids[i : i + len(name)] == name)
    name_positions = torch.arange(at_name, at_name + len(name))
    kept_by_band = kept_without = 0
    for layer, (plain, kept) in enumerate(
        zip(banded.layers, named.layers, strict=True)
    ):
        for h in range(kept.num_heads):
            _, beta, values, idx = kept.head(h)
            _, plain_beta, plain_values, plain_idx = plain.head(h)
            if not band[layer]:
                assert torch.equal(idx, plain_idx) and torch.equal(beta, plain_beta)
                assert torch.equal(values, plain_values)
                continue
            at = torch.isin(idx, name_positions)
            assert not beta[at].any(), (layer, h)
            torch.testing.assert_close(values[at], kv.values[layer][h, idx[at]])
            kept_by_band += int(at.sum())
            kept_without += int(torch.isin(plain_idx, name_positions).sum())
    assert kept_by_band > kept_without


def test_an_identifiers_shape_is_the_length_and_kind_of_each_part():
    assert identifier_shape("TCK-48213") == ((3, "letters"), (5, "digits"))
    assert identifier_shape("TCK-48213") == identifier_shape("TCK-90417")
    assert identifier_shape("a3f9c2e1b7d4") == identifier_shape("35c790730b59")
    assert identifier_shape("531-354-7468") != identifier_shape("2024-05-17")
    assert identifier_shape("524533559245") != identifier_shape("5245335592")


SINGULAR_TEXT = (
    "The log shows commit a3f9c2e1b7d4: add retry, and commit 35c790730b59: fix rounding. "
    "Ticket TCK-48213 is open, ticket TCK-90417 is closed. "
    "My phone number is 531-354-7468, and my sister's name is Rosalind. "
    "We met Dickens at the fair, later we read Dickens, and then we read more Dickens at home. "
    "The key is 481736."
)


def test_singular_tokens_are_the_words_with_no_look_alike_in_the_content(smollm2):
    ids = smollm2.tokenizer(SINGULAR_TEXT, add_special_tokens=False)["input_ids"]
    content = torch.ones(len(ids), dtype=torch.bool)

    def spelled(mask: torch.Tensor) -> str:
        return smollm2.tokenizer.decode([i for i, m in zip(ids, mask.tolist()) if m])

    # two hashes and two tickets are families, a name said three times is a subject, not a
    # fact: of the protected words only the phone number, the key, the name said once and
    # "Ticket" remain
    protected = protected_tokens(
        ids, smollm2.tokenizer, "identifiers-names", content, None
    )
    singular = singular_tokens(ids, smollm2.tokenizer, content)
    assert spelled(protected & singular) == "531-354-7468 Rosalind481736"
    assert "Dickens" in spelled(protected) and "TCK" in spelled(protected)
    # look-alikes outside the content do not count: with the second ticket's sentence out of
    # it, the first ticket is said once
    closed = SINGULAR_TEXT.index("ticket TCK-90417")
    before = len(
        smollm2.tokenizer(SINGULAR_TEXT[:closed], add_special_tokens=False)["input_ids"]
    )
    content[before : before + 8] = False
    assert "TCK-48213" in spelled(singular_tokens(ids, smollm2.tokenizer, content))
    assert not singular_tokens(ids, None, content).any()


def test_a_singular_floor_raises_the_words_said_once_and_not_their_look_alikes(smollm2):
    messages = [
        {
            "role": "user",
            "content": "I keep notes on my accounts here. " * 4
            + SINGULAR_TEXT
            + " The rest of this message is about the weather and the garden." * 6,
        }
    ]
    common = dict(ratio=0.2, queries="context-prefill", on_policy=False)
    # protect_room=head: every identifier and name is protected, whatever the room
    spec = (
        "am-highest-attn:protect=identifiers-names,protect_by=selection,"
        "protect_room=head,priority_beta_floor=1"
    )
    every = compact(smollm2, messages, method=spec, **common)
    singular = compact(smollm2, messages, method=f"{spec},floor_on=singular", **common)
    assert (every.options["floor_on"], singular.options["floor_on"]) == (
        "all",
        "singular",
    )
    ids = singular.token_ids

    def positions(word: str) -> torch.Tensor:
        piece = smollm2.tokenizer(word, add_special_tokens=False)["input_ids"]
        at = next(i for i in range(len(ids)) if ids[i : i + len(piece)] == piece)
        return torch.arange(at, at + len(piece))

    said_once = torch.cat([positions("531-354-7468"), positions(" Rosalind")])
    family = torch.cat([positions(" TCK-48213"), positions(" TCK-90417")])
    raised = below = 0
    for plain, kept in zip(every.layers, singular.layers, strict=True):
        for h in range(kept.num_heads):
            _, beta, _, idx = kept.head(h)
            _, plain_beta, _, plain_idx = plain.head(h)
            # the floor changes the fit, never which keys are kept
            assert torch.equal(idx, plain_idx)
            if len(idx) == len(ids):
                continue  # a head that keeps every key is not fitted (beta = 0)
            once, alike = torch.isin(idx, said_once), torch.isin(idx, family)
            assert (beta[once] >= 1 - 1e-4).all() and (
                plain_beta[alike] >= 1 - 1e-4
            ).all()
            raised += int(once.sum())
            below += int((beta[alike] < 1 - 1e-4).sum())
    # the words said once are kept and raised; some kept look-alike is no longer raised
    assert raised > 0 and below > 0


def test_a_ranked_template_is_what_lies_between_the_sinks_and_the_last_content_token():
    content = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0], dtype=torch.bool)
    ranked = ranked_template(content)
    assert ranked.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0]
    # content among the sinks stays content; nothing to rank without content
    assert ranked_template(torch.ones(6, dtype=torch.bool)).sum() == 0
    assert ranked_template(torch.zeros(6, dtype=torch.bool)).sum() == 0
    with pytest.raises(ValueError, match="template must be one of exact, ranked"):
        resolve("kvzip:template=all")
    assert resolve("kvzip").template == "exact"
    assert resolve("kvzip:template=ranked").template == "ranked"


def test_a_ranked_template_is_compacted_with_the_content_in_as_many_slots(smollm2):
    messages = [
        {"role": "user", "content": "Tell me about the garden and the weather. " * 8},
        {
            "role": "assistant",
            "content": "The garden is green and the sky is clear. " * 8,
        },
        {
            "role": "user",
            "content": "And my account number is 524533559245, remember it.",
        },
    ]
    ids, content = smollm2.chat_content(messages)
    template = torch.nonzero(~content).flatten()
    exact = compact(smollm2, messages, ratio=0.1, method="kvzip")
    ranked = compact(smollm2, messages, ratio=0.1, method="kvzip:template=ranked")
    assert (
        ranked.options["template"] == "ranked" and exact.options["template"] == "exact"
    )
    # the same total, up to rounding per head, with the template's slots given to the ranking
    heads = sum(layer.num_heads for layer in ranked.layers)
    assert abs(ranked.physical_slots - exact.physical_slots) <= heads
    assert ranked.compacted_span[0] == SINK_TOKENS
    after_content = template[template > int(torch.nonzero(content)[-1])]
    dropped = 0
    for with_exact, with_ranked in zip(exact.layers, ranked.layers, strict=True):
        for h in range(with_ranked.num_heads):
            assert torch.isin(template, with_exact.head(h)[3]).all()
            idx = with_ranked.head(h)[3]
            # the sinks and the tokens after the last content token stay in every head
            assert torch.isin(torch.arange(SINK_TOKENS), idx).all()
            assert torch.isin(after_content, idx).all()
            dropped += int((~torch.isin(template, idx)).sum())
    assert dropped > 0
    # t = T: at ratio 1 every token keeps its slot in every head, template ranked or not
    whole = compact(smollm2, messages, ratio=1.0, method="kvzip:template=ranked")
    assert whole.physical_slots == len(ids) * heads


def test_protect_room_head_leaves_the_cap_to_each_heads_selection(smollm2):
    """``protect_room="mean"`` caps what a rule marks at half the mean head budget, so at a small
    ratio the later names are never protected, even in the heads with room for them;
    ``"head"`` marks every one and each head keeps the ones it scores best, within half its own
    budget. Where the mean cap does not bind the two compact the same, slot for slot."""
    text = (
        "We talked about gardens. Oh, and my sister's name is Rosalind. "
        "Last year I moved to Ljubljana, near my key 481736. Then we had lunch."
    )
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    content = torch.ones(len(ids), dtype=torch.bool)
    digits = len(smollm2.tokenizer("481736")["input_ids"])
    capped = protected_tokens(
        ids, smollm2.tokenizer, "identifiers-names", content, 2 * digits
    )
    every = protected_tokens(ids, smollm2.tokenizer, "identifiers-names", content, None)
    assert int(capped.sum()) == digits and bool((capped <= every).all())
    assert (
        smollm2.tokenizer.decode([i for i, keep in zip(ids, every.tolist()) if keep])
        == " Rosalind Ljubljana481736"
    )
    names = "Rosalind Bartholomew Ambrose Philippa Thaddeus Ljubljana Brisbane Nairobi"
    messages = [
        {
            "role": "user",
            "content": "The rest of this message is about the weather and the garden. "
            * 4
            + " ".join(f"Then I met {name}, and we talked." for name in names.split())
            + " The rest of this message is about the weather and the garden. " * 4,
        }
    ]
    common = dict(ratio=0.1, queries="context-prefill", on_policy=False)
    spec = "am-highest-attn:protect=identifiers-names,protect_by=selection"
    mean = compact(smollm2, messages, method=spec, **common)
    head = compact(smollm2, messages, method=f"{spec},protect_room=head", **common)
    assert head.options["protect_room"] == "head"
    assert head.options["protected_tokens"] > mean.options["protected_tokens"]
    assert head.physical_slots == mean.physical_slots
    # every head whose share holds all the marked tokens keeps every one of them first, and the
    # heads keep more of them in all than under the mean cap
    ids = head.token_ids
    # one message: its content is the compacted span, the template's slots lie outside it
    start, end = head.compacted_span
    in_span = torch.zeros(len(ids), dtype=torch.bool)
    in_span[start:end] = True
    marked = protected_tokens(
        ids, smollm2.tokenizer, "identifiers-names", in_span, None
    )
    assert int(marked.sum()) == head.options["protected_tokens"]
    positions = torch.nonzero(marked).flatten()
    roomy_heads, kept = 0, {"mean": 0, "head": 0}
    for room, cache in (("mean", mean), ("head", head)):
        for layer in cache.layers:
            for h in range(layer.num_heads):
                _, _, _, idx = layer.head(h)
                holds = int(torch.isin(idx, positions).sum())
                kept[room] += holds
                content_slots = int(((idx >= start) & (idx < end)).sum())
                if room == "head" and content_slots * PRIORITY_SHARE >= len(positions):
                    assert holds == len(positions)
                    roomy_heads += 1
    assert roomy_heads > 0 and kept["head"] > kept["mean"]
    # where the mean cap does not bind, the room changes nothing
    roomy = dict(common, ratio=0.6)
    same = compact(smollm2, messages, method=spec, **roomy)
    also = compact(smollm2, messages, method=f"{spec},protect_room=head", **roomy)
    for a, b in zip(same.layers, also.layers, strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    with pytest.raises(ValueError, match="protect_room=head .* not exact"):
        resolve("am:protect_by=exact,protect_room=head")
    with pytest.raises(ValueError, match="protect_room must be one of mean, head"):
        resolve("am:protect_room=all")
    assert resolve("am").protect_room == "mean"
