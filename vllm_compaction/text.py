"""Words found in a token sequence's text, located back on its tokens.

Rules that act on words (protecting identifiers, probing numbers) search the decoded text with a
regular expression and then need the tokens each match covers. Decoding token by token, without
the tokenizer's clean-up, keeps every character where the tokens put it, so a match's character
offsets in the joined pieces map to token indices.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["token_pieces", "word_tokens"]


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
