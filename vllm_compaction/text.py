"""Words found in a token sequence's text, located back on its tokens.

Rules that act on words (protecting identifiers, probing numbers) search the decoded text with a
regular expression and then need the tokens each match covers. Decoding token by token, without
the tokenizer's clean-up, keeps every character where the tokens put it, so a match's character
offsets in the joined pieces map to token indices.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "MIN_NUMBER_DIGITS",
    "name_words",
    "number_words",
    "token_pieces",
    "word_tokens",
]


def token_pieces(tokenizer: Any, token_ids: Sequence[int] | torch.Tensor) -> list[str]:
    """The text of each token of ``token_ids`` on its own; joined, they spell the sequence."""
    return tokenizer.batch_decode(
        [[int(token)] for token in token_ids], clean_up_tokenization_spaces=False
    )


def word_tokens(
    pieces: Sequence[str], pattern: re.Pattern[str]
) -> Iterator[tuple[str, range]]:
    """Each match of ``pattern`` in the text the tokens ``pieces`` spell, in order, with the
    indices of the tokens that overlap its characters."""
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    for match in pattern.finditer("".join(pieces)):
        # the token holding the first character (past any empty tokens at that offset) through
        # the last token that starts before the match ends
        first = bisect.bisect_right(offsets, match.start()) - 1
        last = bisect.bisect_left(offsets, match.end()) - 1
        yield match.group(), range(first, last + 1)


#: a word that may hold a number: letters, digits and the marks inside times, versions and codes
_NUMBER_WORD = re.compile(r"[A-Za-z0-9](?:[\w\-.:]*[A-Za-z0-9])?")
#: digits a word needs to count as a number (``v2`` or ``a`` do not, ``42`` and ``12:30`` do)
MIN_NUMBER_DIGITS = 2
#: a name inside a sentence: capitalised words (``Granite Peak Software``, ``Jean-Luc``) after a
#: lower-case letter, a digit or a mark that does not end a sentence, and one space or line break;
#: a sentence's first word, and ``I``, are not names
_NAME_WORD = re.compile(r"(?<=[a-z0-9,;:)][ \n])[A-Z][a-z]+(?:[ -][A-Z][a-z]+)*")


def _words(
    pieces: Sequence[str], pattern: re.Pattern[str], keep: Callable[[str], bool]
) -> list[range]:
    """The tokens of each match of ``pattern`` that ``keep`` accepts, in the text the tokens
    ``pieces`` spell, in order; one per first token (two words that begin in one token are
    one)."""
    words: list[range] = []
    for word, tokens in word_tokens(pieces, pattern):
        if keep(word) and (not words or words[-1].start != tokens.start):
            words.append(tokens)
    return words


def number_words(pieces: Sequence[str]) -> list[range]:
    """The tokens of each number-like word (``MIN_NUMBER_DIGITS`` digits or more) in the text
    the tokens ``pieces`` spell, in order."""
    return _words(
        pieces,
        _NUMBER_WORD,
        lambda word: sum(c.isdigit() for c in word) >= MIN_NUMBER_DIGITS,
    )


def name_words(pieces: Sequence[str]) -> list[range]:
    """The tokens of each name inside a sentence (``_NAME_WORD``) in the text the tokens
    ``pieces`` spell, in order."""
    return _words(pieces, _NAME_WORD, lambda word: True)
