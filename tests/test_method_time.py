"""``benchmarks.method_time``: methods timed side by side on the same real instance (SmolLM2),
the ratio to the first method recorded, and a bad method refused before any work."""

from __future__ import annotations

import json

import pytest

from benchmarks import method_time

pytestmark = pytest.mark.slow


def test_two_methods_are_timed_on_the_same_instance(tmp_path):
    out = tmp_path / "time.json"
    result = method_time.main(
        [
            "--methods",
            "am-highest-attn-fast;am-highest-attn-fast:refine_steps=3,refine_batch=64",
            "--tasks",
            "chat-facts",
            "--seeds",
            "0",
            "--tokens",
            "600",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == result
    rows = result["methods"]
    assert list(rows) == [
        "am-highest-attn-fast",
        "am-highest-attn-fast:refine_steps=3,refine_batch=64",
    ]
    first = rows["am-highest-attn-fast"]
    assert first["ratio_to_first_median"] == 1.0
    for row in rows.values():
        assert len(row["seconds"]) == 1 and row["median_s"] > 0
    assert result["instances"] == [{"task": "chat-facts", "seed": 0}]
    assert result["tokens"] == 600


@pytest.mark.parametrize(
    ("argv", "sentence"),
    [
        (["--methods", "am:refine_steps=-1"], "refine_steps must be"),
        (["--methods", " ; "], "names no method"),
        (["--methods", "am", "--tokens", "0"], "--tokens must be a positive length"),
        (["--methods", "am", "--tasks", "chat-fact"], "unknown task(s) chat-fact"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(argv, sentence, capsys):
    with pytest.raises(SystemExit) as exit_:
        method_time.main(argv)
    assert exit_.value.code == 2
    assert sentence in capsys.readouterr().err
