"""``surprise-recap``: the assistant restates, in the second person, each sentence that holds a
name or a number.

A later question about something the user said is answered in the second person ("What is my
sister's name?" -> "Your sister's name is ..."), and the answer's first token is fetched by queries
that read the fact's own words with the person changed. A quote probe repeats the user's words
(first person), a cloze probe blanks the word out of them; with the real question and answer
among the probes 12 of the 22 answers the default lost at 10% came back, where quote and cloze
probes on the same facts did not ("Would the question's own queries keep them?" and
"Fill-in-the-blank questions as probes" in docs/experiments). This source writes the restatement
by rule: the sentence holding the word, its first-person words turned to the second person
(``I`` -> ``you``, ``my`` -> ``your``, ``I'm`` -> ``you're``...), teacher-forced as the answer to
a fixed question::

    user:      What did I tell you?
    assistant: Oh, and your sister's name is Bartholomew.

The words are those ``surprise-cloze`` blanks (the numbers and codes of
``surprise-number-quote``, the names of ``surprise-name-quote``, up to ``count`` of each); two
words in one sentence make one probe. Sentences without a first-person word (a tool's output, an
essay) are restated as they stand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_compaction.queries.base import PrefixSpec, QueryPlan
from vllm_compaction.queries.surprise_cloze import SentenceProbes, sentence_bounds

__all__ = ["RECAP_QUESTION", "SurpriseRecap", "second_person"]

RECAP_QUESTION = "What did I tell you?"

#: first-person words and their second-person form (case as written: "I" is always capitalised)
_SECOND_PERSON = {
    "I'm": "you're", "I've": "you've", "I'd": "you'd", "I'll": "you'll", "I": "you",
    "me": "you", "my": "your", "My": "Your", "mine": "yours", "myself": "yourself",
    "we": "you", "We": "You", "our": "your", "Our": "Your", "ours": "yours", "us": "you",
}  # fmt: skip
_FIRST_PERSON = re.compile(
    r"(?<![\w'])("
    + "|".join(sorted(_SECOND_PERSON, key=len, reverse=True))
    + r")(?![\w'])"
)


def second_person(text: str) -> str:
    """``text`` with its first-person words in the second person; a sentence's first word keeps
    its capital ("I moved to Oslo." -> "You moved to Oslo.")."""

    def swap(match: re.Match[str]) -> str:
        word = _SECOND_PERSON[match.group(0)]
        start = match.start()
        opens = not text[:start].strip() or text[:start].rstrip()[-1] in ".!?\n"
        return word[0].upper() + word[1:] if opens else word

    return _FIRST_PERSON.sub(swap, text)


@dataclass
class SurpriseRecap(SentenceProbes):
    name: str = "surprise-recap"
    lead: int = 16
    question: str = RECAP_QUESTION

    def plan(self, adapter, prefix: PrefixSpec) -> QueryPlan:
        content, pieces, words = self.probed_words(adapter, prefix)
        turn = adapter.turn_ids([{"role": "user", "content": self.question}])
        # in order of position; two words of one sentence, or bounds that differ only by a line
        # break, restate the same text: one probe for it
        bounds = (sentence_bounds(pieces, word, self.lead, self.tail) for word in words)
        restated = dict.fromkeys(
            second_person(
                " ".join(adapter.tokenizer.decode(content[first:end]).split())
            )
            for first, end in bounds
        )
        continuations = [
            turn + adapter.tokenizer.encode(text, add_special_tokens=False)
            for text in restated
        ]
        return QueryPlan(
            continuations=continuations, record_from=[0] * len(continuations)
        )
