"""Spans kept exact: content tokens that bypass the fit, stored as they are in every head.

Compaction keeps the keys that carry most attention mass. An identifier said once (an account
number, a licence key, a phone number) is many low-mass tokens whose order matters: SmolLM2
writes digits one token each, and a compacted prefix that keeps some of them answers with
a number that is close but wrong. ``protect="identifiers"`` keeps every token of each
identifier-like word exact, as the chat template's tokens are kept, and takes their slots from
the budget, so the prefix keeps its size.

An identifier is a word of letters, digits, ``-`` and ``_`` (starting and ending with a letter or
digit) at least ``MIN_IDENTIFIER_CHARS`` long with at least one digit: ``524533559245``,
``AB1C-D2EF-GH3I``, ``531-354-7468``, ``a3f9c2e1b7d4``, not ``2005`` or ``Krakow``. Protected
tokens never take more than ``MAX_PROTECTED_SHARE`` of the budget; past it, the longest
identifiers are kept first (ties: the earlier one).

``protect="identifier-phrases"`` also keeps the words that lead up to each identifier in its
sentence, at most ``LEAD_TOKENS`` tokens back ("the door code for the back door is"): with
near-duplicate keys the value alone is not enough, the model must still tell which key it
belongs to. The identifiers take the room first, then the phrases, in order. Measured on the
conversation tasks at 10% it answers as ``identifiers`` does (benchmarks/README.md).

``protect="identifiers-names"`` also protects each name inside a sentence (capitalised words after
a lower-case word or a comma: "my sister's name is Rosalind", ``text.name_words``), after the
identifiers, in order, while room is left. A fact said in passing is often a name the model
would otherwise guess ("Emily"); with ``protect_by="selection"`` each head that scores it keeps
it first, and the fit's ``priority_beta_floor`` and ``priority_values`` apply to it as to an
identifier (``am.presets.FitOptions``).

``protect="identifiers-facts"`` protects, after the identifiers, the short facts said in passing
(``fact_spans``): each number too short to be an identifier ("room 42", "the code is 7319") and
each name inside a sentence, said at most ``MAX_FACT_MENTIONS`` times in the content, in order,
while room is left. A fact stated in a conversation is said once, or twice where a reply repeats
it; a name or a number the text keeps coming back to is its subject, which the selection keeps
anyway. These are the words lost over repeated compaction of an agent session (a codename, a
room, a vault's code). On the conversation families, with ``floor_on="singular"``, it kept 3
answers more than the default at 10% and 2 fewer at 5%: in essays and traces it also marks
names and years of the text, which take the places of context keys (benchmarks/README.md).

How they are kept is ``protect_by``: ``"exact"`` (the default above: their own slots in every
head, outside the fit) or ``"selection"``: each head's selector keeps them before any other
key, up to half of that head's budget (the ones it scores best), and they are fitted as any
kept key. A token the selection would keep anyway then costs nothing, and a head with a small
budget keeps only the protected tokens it scores best, where ``exact`` pays for every
protected token in every head. ``"whole"`` is ``selection`` by identifier: each head ranks the
protected spans by their best-scored token and keeps the best ones whole while they fit its
half, so a head keeps all of a number's digits or none of them (``span_ids``).

How many tokens a rule may mark is ``protect_room``: ``"mean"`` (the default) stops at
``MAX_PROTECTED_SHARE`` of the mean head budget, in the rule's order (the longest identifiers,
then the names as they come), which ``exact`` needs since it pays for each in every head;
``"head"`` (``selection`` or ``whole`` only) marks every one the rule finds and leaves the cap to
each head's selection. Global budgets give the retrieval heads several times the mean, and at 5%
the mean cap stops the names after the first few dozen tokens, so the heads that read a name
said late in a conversation never keep it first. For ``am`` (identifiers only) the two differ
only below 10%, where ``head`` measured one agent trace fewer at 5% and the same at 2%, so
``mean`` stays the default (docs/experiments).

``floor_on`` picks the kept protected tokens that the fit's ``priority_beta_floor`` raises:
``"all"`` (the default) or ``"singular"``, only the words with no look-alike in the prefix: a
short number or a name said at most ``MAX_FACT_MENTIONS`` times, an identifier whose shape
(``identifier_shape``: the length and kind of each part between ``-`` and ``_``) no other
identifier shares (``singular_tokens``). A floor raises
every kept token it covers, so a family of look-alikes (two commit hashes, an open and a closed
ticket, six-digit codes sharing their first digits) is raised together, and an answer may name
the neighbour too. Measured on the conversation tasks at 10% (``priority_beta_floor=1``),
``singular`` gave back 7 of the default's 16 losses where ``all`` gave back 9, and lost 3 of 40
sampled wins where ``all`` lost 2: raising a family of near-duplicate keys together helps more
than it confuses (docs/experiments).

The tokens outside the content (the chat template's role headers and turn ends, a default
system prompt) are kept as ``template`` says: ``"exact"`` (the default: each in its own slot in
every head, as a protected token by ``exact``) or ``"ranked"``: ranked and fitted with the
content, the first ``SINK_TOKENS`` of the prefix excepted, and the prefix keeps the same number of
slots, its budget raised by the template tokens it no longer keeps exact. ``ranked`` is how
KVzip budgets a context (it ranks every pair but its attention sinks); AM reads the turns by
their template tokens and keeps more answers with them exact (docs/experiments).

``priority_exact_depth="lo-hi"`` (with ``protect_by`` ``selection`` or ``whole``) keeps the
protected tokens each head keeps as they were (``priority_values="exact"``: their own value and
``beta = 0``) only in the layers between those shares of the model's depth, and fits them as any
kept key in the others. A question reads a fact said in passing in a band of middle-to-late
layers (its retrieval heads); there the token itself must answer, while in the layers outside
the band a kept name's fitted value also stands for the neighbours it replaced
(docs/experiments). A layer ``l`` of ``L`` is in the band when its middle, ``(l + 0.5) / L``, is
in ``[lo, hi)``, so a band carries across models of different depth (``depth_band``).
``band_protect`` is the rule inside the band (``protect`` unless given): with
``protect=identifiers,band_protect=identifiers-names`` the names are kept first, as they were,
in the band only, and every other layer is the plain ``protect=identifiers`` one. Names kept
first in every layer cost the agent traces' commit hashes (docs/experiments).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from vllm_compaction.text import name_words, number_words, token_pieces, word_tokens

logger = logging.getLogger(__name__)

__all__ = [
    "LEAD_TOKENS",
    "MAX_FACT_MENTIONS",
    "MAX_PROTECTED_SHARE",
    "MIN_IDENTIFIER_CHARS",
    "PROTECT_MODES",
    "PROTECT_ROOMS",
    "PROTECT_RULES",
    "SINK_TOKENS",
    "TEMPLATE_MODES",
    "check_priority_exact_depth",
    "check_protect",
    "check_protect_by",
    "check_protect_room",
    "depth_band",
    "check_template",
    "FLOOR_SETS",
    "check_floor_on",
    "identifier_shape",
    "fact_spans",
    "singular_tokens",
    "identifier_spans",
    "lead_spans",
    "protected_tokens",
    "ranked_template",
    "span_ids",
]

#: ``none``: nothing is protected; ``identifiers``, ``identifier-phrases``,
#: ``identifiers-names``, ``identifiers-facts``: see the module doc.
PROTECT_RULES = (
    "none",
    "identifiers",
    "identifier-phrases",
    "identifiers-names",
    "identifiers-facts",
)
#: how protected tokens are kept (``protect_by``): their own exact slots, first in each head's
#: selection token by token, or whole identifiers first
PROTECT_MODES = ("exact", "selection", "whole")
MIN_IDENTIFIER_CHARS = 6
#: how the tokens outside the content are kept (``template``): exact, or ranked with it
TEMPLATE_MODES = ("exact", "ranked")
#: how many content tokens a protect rule may mark (``protect_room``): at most
#: ``MAX_PROTECTED_SHARE`` of the mean head budget, or every one it finds (each head's selection
#: then keeps the ones it scores best, up to its own share)
PROTECT_ROOMS = ("mean", "head")
#: the first tokens of a prefix, which ``template="ranked"`` still keeps exact: attention
#: sinks, which every head attends to whatever the query (KVzip keeps 4)
SINK_TOKENS = 4
#: how far back a phrase reaches from its identifier, in tokens: a key of a few words and its
#: verb ("The door code for the back door is" is 9)
LEAD_TOKENS = 10
#: a phrase stops after the token that ends the previous sentence or line
_SENTENCE_END = re.compile(r"[.!?\n]")
#: which kept protected tokens ``priority_beta_floor`` raises (``floor_on``): every one, or the
#: words with no look-alike in the prefix
FLOOR_SETS = ("all", "singular")
#: how often a short number or a name may appear in the content and still count as a fact
#: said in passing (``fact_spans``): once, and once more where a reply repeats it ("Got it:
#: the code is 7319"); a word the text keeps coming back to (an essay's subject) is not one
MAX_FACT_MENTIONS = 2
#: the largest share of a prefix's slots that protected tokens may take
MAX_PROTECTED_SHARE = 0.5
_WORD = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_\-]*[A-Za-z0-9])?")


def _one_of(option: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{option} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def check_protect(rule: Any) -> str:
    """``rule`` if it names a protection rule; ``ValueError`` with the choices otherwise."""
    return _one_of("protect", rule, PROTECT_RULES)


def check_protect_by(mode: Any) -> str:
    """``mode`` if it names a way to keep protected tokens; ``ValueError`` otherwise."""
    return _one_of("protect_by", mode, PROTECT_MODES)


def check_priority_exact_depth(band: Any) -> tuple[float, float] | None:
    """``"lo-hi"`` (shares of the model's depth, ``0 <= lo < hi <= 1``) as ``(lo, hi)``;
    ``None`` or ``"none"`` as ``None``; ``ValueError`` with a sentence otherwise."""
    if band is None or (isinstance(band, str) and band.strip().lower() == "none"):
        return None
    usage = (
        "priority_exact_depth is a band of depth 'lo-hi' with 0 <= lo < hi <= 1 "
        f"(e.g. '0.56-0.84'), or 'none'; got {band!r}"
    )
    if not isinstance(band, str):
        raise ValueError(usage)
    lo_text, dash, hi_text = band.strip().partition("-")
    try:
        lo, hi = float(lo_text), float(hi_text)
    except ValueError:
        raise ValueError(usage) from None
    if not dash or not 0.0 <= lo < hi <= 1.0:
        raise ValueError(usage)
    return lo, hi


def depth_band(band: tuple[float, float], num_layers: int) -> list[bool]:
    """Per layer of a model ``num_layers`` deep, whether its middle, ``(l + 0.5) / L``, is in
    ``band`` ``[lo, hi)`` (``hi = 1`` takes the last layer)."""
    lo, hi = band
    return [lo <= (layer + 0.5) / num_layers < hi for layer in range(num_layers)]


def check_protect_room(room: Any, protect_by: str) -> str:
    """``room`` if it names a protect room that ``protect_by`` can use; ``ValueError`` otherwise.
    ``"head"`` leaves the cap to each head's selection, so it needs ``selection`` or ``whole``:
    ``exact`` pays a slot in every head for every protected token."""
    room = _one_of("protect_room", room, PROTECT_ROOMS)
    if room == "head" and protect_by == "exact":
        raise ValueError(
            "protect_room=head leaves the cap on protected tokens to each head's selection: "
            "it needs protect_by selection or whole, not exact (which keeps every protected "
            "token in every head)"
        )
    return room


def check_floor_on(which: Any) -> str:
    """``which`` if it names the protected tokens a floor raises; ``ValueError`` otherwise."""
    return _one_of("floor_on", which, FLOOR_SETS)


def check_template(mode: Any) -> str:
    """``mode`` if it names a way to keep the template's tokens; ``ValueError`` otherwise."""
    return _one_of("template", mode, TEMPLATE_MODES)


def ranked_template(content: torch.Tensor, sinks: int = SINK_TOKENS) -> torch.Tensor:
    """``[T]`` bool host mask of the tokens outside ``content`` that ``template="ranked"``
    compacts with it: past the first ``sinks`` and before the last content token. The ones after
    it (the last turn's end, a recent turn kept exact with ``keep_last_tokens``) stay exact."""
    content = torch.as_tensor(content, dtype=torch.bool, device="cpu")
    ranked = torch.zeros_like(content)
    where = torch.nonzero(content).flatten()
    if where.numel():
        ranked[sinks : int(where[-1])] = True
    return ranked & ~content


def _content_pieces(
    tokenizer: Any, token_ids: Sequence[int] | torch.Tensor, allowed: Sequence[bool]
) -> list[str]:
    """The text of each token (``text.token_pieces``), the ones outside the content blanked to
    as many spaces: a word is found in the content alone, and a turn's first word, after its
    role header's line break, is not taken for a name inside a sentence."""
    pieces = token_pieces(tokenizer, token_ids)
    return [
        p if keep else " " * len(p) for p, keep in zip(pieces, allowed, strict=True)
    ]


def _is_identifier(word: str) -> bool:
    return len(word) >= MIN_IDENTIFIER_CHARS and any(c.isdigit() for c in word)


def identifier_spans(pieces: Sequence[str]) -> list[list[int]]:
    """Token indices of each identifier in the text the tokens ``pieces`` spell, in order."""
    return [
        list(tokens)
        for word, tokens in word_tokens(pieces, _WORD)
        if _is_identifier(word)
    ]


def identifier_shape(word: str) -> tuple[tuple[int, str], ...]:
    """The length and kind (``"digits"``, ``"letters"`` or ``"mixed"``) of each part of
    ``word`` between ``-`` and ``_``: two hex hashes of one length, or ``TCK-48213`` and
    ``TCK-90417``, share a shape; a phone number and a date do not."""
    parts = re.split(r"[-_]", word)
    return tuple(
        (
            len(part),
            "digits" if part.isdigit() else "letters" if part.isalpha() else "mixed",
        )
        for part in parts
    )


def fact_spans(pieces: Sequence[str], allowed: Sequence[bool]) -> list[list[int]]:
    """Token indices of each short fact word in the ``allowed`` tokens' text, in order: a
    number (``text.number_words``) too short to be an identifier (``42``, ``7319``, ``12:30``)
    or a name inside a sentence (``text.name_words``), each of whose words appears at most
    ``MAX_FACT_MENTIONS`` times there."""
    said: Counter[str] = Counter()
    # the content's words by the token they begin in
    starting: dict[int, list[str]] = {}
    for word, tokens in word_tokens(pieces, _WORD):
        if all(allowed[i] for i in tokens):
            said[word] += 1
            starting.setdefault(tokens.start, []).append(word)
    spans = []
    for span in sorted(
        number_words(pieces) + name_words(pieces), key=lambda r: r.start
    ):
        own = [word for at in span for word in starting.get(at, [])]
        if (
            own
            and all(allowed[i] for i in span)
            and all(
                said[word] <= MAX_FACT_MENTIONS and not _is_identifier(word)
                for word in own
            )
        ):
            spans.append(list(span))
    return spans


def singular_tokens(
    token_ids: Sequence[int] | torch.Tensor, tokenizer: Any, content: torch.Tensor
) -> torch.Tensor:
    """``[T]`` bool host mask of the ``content`` tokens of words with no look-alike in it: each
    identifier (``identifier_spans``) whose ``identifier_shape`` no other identifier of the
    content shares, and each short number or name said at most ``MAX_FACT_MENTIONS`` times
    (``fact_spans``; ``floor_on="singular"``)."""
    singular = torch.zeros(content.numel(), dtype=torch.bool, device="cpu")
    if tokenizer is None or not bool(content.any()):
        return singular
    allowed = content.tolist()
    pieces = _content_pieces(tokenizer, token_ids, allowed)
    identifiers = [
        (word, tokens)
        for word, tokens in word_tokens(pieces, _WORD)
        if _is_identifier(word) and all(allowed[i] for i in tokens)
    ]
    shapes = Counter(identifier_shape(word) for word, _ in identifiers)
    for word, tokens in identifiers:
        if shapes[identifier_shape(word)] == 1:
            singular[list(tokens)] = True
    for span in fact_spans(pieces, allowed):
        singular[span] = True
    return singular


def lead_spans(
    pieces: Sequence[str], spans: Sequence[Sequence[int]], allowed: Sequence[bool]
) -> list[list[int]]:
    """For each identifier span, the token indices of the phrase before it: back to the end of
    the previous sentence or line, another identifier, a token not in ``allowed`` (template
    tokens), or ``LEAD_TOKENS`` tokens, whichever comes first."""
    taken = {i for span in spans for i in span}
    leads = []
    for span in spans:
        lead: list[int] = []
        at = span[0] - 1
        while (
            at >= 0
            and len(lead) < LEAD_TOKENS
            and allowed[at]
            and at not in taken
            and not _SENTENCE_END.search(pieces[at])
        ):
            lead.insert(0, at)
            at -= 1
        leads.append(lead)
    return leads


def protected_tokens(
    token_ids: Sequence[int] | torch.Tensor,
    tokenizer: Any,
    rule: str,
    content: torch.Tensor,
    slots: float | None,
) -> torch.Tensor:
    """``[T]`` bool host mask of the ``content`` tokens that ``rule`` keeps exact, at most
    ``MAX_PROTECTED_SHARE * slots`` of them (``slots``: the budget per head, in tokens), or all
    of them when ``slots`` is ``None`` (``protect_room="head"``)."""
    protected = torch.zeros(content.numel(), dtype=torch.bool, device="cpu")
    if check_protect(rule) == "none" or not bool(content.any()):
        return protected
    if tokenizer is None:
        # identifiers are found in the text; a model loaded without its tokenizer compacts as
        # the unprotected method does (the cache records protected_tokens = 0)
        logger.warning(
            "protect=%s needs the model's tokenizer to find identifiers; this model has "
            "none, so nothing is protected (pass protect=none to silence this)",
            rule,
        )
        return protected
    allowed = content.tolist()
    pieces = _content_pieces(tokenizer, token_ids, allowed)
    spans = [span for span in identifier_spans(pieces) if all(allowed[i] for i in span)]
    room = len(allowed) if slots is None else int(MAX_PROTECTED_SHARE * slots)
    for span in sorted(spans, key=lambda s: (-len(s), s[0])):
        if len(span) <= room:
            protected[span] = True
            room -= len(span)
    if rule in ("identifiers-names", "identifiers-facts"):
        # after the identifiers, in order, while room is left
        words = (
            fact_spans(pieces, allowed)
            if rule == "identifiers-facts"
            else [list(n) for n in name_words(pieces) if all(allowed[i] for i in n)]
        )
        for span in words:
            if len(span) <= room:
                protected[span] = True
                room -= len(span)
    if rule == "identifier-phrases":
        for span, lead in zip(spans, lead_spans(pieces, spans, allowed), strict=True):
            if lead and bool(protected[span[0]]) and len(lead) <= room:
                protected[lead] = True
                room -= len(lead)
    return protected


def span_ids(protected: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64 ids of the runs of adjacent ``protected`` tokens (``-1`` elsewhere): the
    spans ``protect_by="whole"`` keeps whole (``SelectionProblem.priority``)."""
    starts = protected & ~torch.cat([protected.new_zeros(1), protected[:-1]])
    return torch.where(protected, starts.cumsum(0) - 1, -1)
