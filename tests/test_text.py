"""Words found in a token sequence's text map back to exactly the tokens that spell them."""

from __future__ import annotations

import re

from vllm_compaction.text import token_pieces, word_tokens

DIGITS = re.compile(r"\d+")


def test_each_match_gets_the_tokens_that_overlap_its_characters():
    # a number across three tokens, one that starts and ends inside tokens, an empty token
    # before a number (it spells nothing, so the number starts at the next token)
    pieces = ["Call", " 5", "31", "-7", "(", "x12", "3)", "!", "", "44"]
    assert [(word, list(tokens)) for word, tokens in word_tokens(pieces, DIGITS)] == [
        ("531", [1, 2]),
        ("7", [3]),
        ("123", [5, 6]),
        ("44", [9]),
    ]
    assert list(word_tokens([], DIGITS)) == []
    assert list(word_tokens(["no", " digits"], DIGITS)) == []


def test_the_pieces_spell_the_text_as_the_tokenizer_decodes_it(smollm2):
    # the clean-up the tokenizer would do ("Hi ," -> "Hi,") would move characters off their
    # tokens; the pieces keep them where the tokens put them
    text = "Hi , the code is 485538 . Call 531-354-7468 at 12:30 ."
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = token_pieces(smollm2.tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text
    spelled = [
        "".join(pieces[i] for i in tokens).strip()
        for _, tokens in word_tokens(pieces, DIGITS)
    ]
    assert spelled == ["485538", "531", "354", "7468", "12", "30"]
