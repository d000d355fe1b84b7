"""The console script: a real compaction from a file, inspect, and one-sentence errors."""

from __future__ import annotations

import json

import pytest

from vllm_compaction.cli import main


@pytest.mark.slow
def test_compact_then_inspect(tmp_path, capsys, smollm2):
    chat = [
        {"role": "user", "content": "The launch code is 4417. " * 20 + "Remember it."},
        {"role": "assistant", "content": "I will remember the launch code."},
    ]
    src = tmp_path / "chat.json"
    src.write_text(json.dumps(chat))
    out = tmp_path / "cache.safetensors"
    code = main(
        [
            "compact",
            "--input",
            str(src),
            "--ratio",
            "0.2",
            "--method",
            "am-highest-attn-fast",
            "--min-layer-share",
            "0.5",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0 and out.is_file()
    printed = capsys.readouterr().out
    assert "physical_slots" in printed and "timings" in printed
    assert main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "am-highest-attn-fast" and summary["physical_slots"] > 0
    assert summary["options"]["min_layer_share"] == 0.5


@pytest.mark.parametrize(
    "setup, args, message",
    [
        (
            None,
            [
                "compact",
                "--input",
                "{tmp}/missing.txt",
                "--ratio",
                "0.1",
                "--out",
                "{tmp}/c",
            ],
            "does not exist",
        ),
        (
            "{",
            [
                "compact",
                "--input",
                "{tmp}/bad.json",
                "--ratio",
                "0.1",
                "--out",
                "{tmp}/c",
            ],
            "not valid JSON",
        ),
        (
            "[1, 2]",
            [
                "compact",
                "--input",
                "{tmp}/bad.json",
                "--ratio",
                "0.1",
                "--out",
                "{tmp}/c",
            ],
            "chat messages",
        ),
        (
            "hi",
            [
                "compact",
                "--input",
                "{tmp}/bad.txt",
                "--ratio",
                "1.5",
                "--out",
                "{tmp}/c",
            ],
            "--ratio",
        ),
        (
            "hi",
            [
                "compact",
                "--input",
                "{tmp}/bad.txt",
                "--ratio",
                "0.1",
                "--method",
                "zip",
                "--out",
                "{tmp}/c",
            ],
            "unknown method",
        ),
        (
            "hi",
            [
                "compact",
                "--input",
                "{tmp}/bad.pdf",
                "--ratio",
                "0.1",
                "--out",
                "{tmp}/c",
            ],
            "unsupported input",
        ),
        (
            "hi",
            [
                "compact",
                "--input",
                "{tmp}/bad.txt",
                "--ratio",
                "0.1",
                "--min-layer-share",
                "2",
                "--out",
                "{tmp}/c",
            ],
            "--min-layer-share",
        ),
        (
            "hi",
            [
                "compact",
                "--input",
                "{tmp}/bad.txt",
                "--ratio",
                "0.1",
                "--min-layer-share",
                "0.5",
                "--budgets",
                "uniform",
                "--out",
                "{tmp}/c",
            ],
            "global budgets only",
        ),
        (
            "hi",
            [
                "compact",
                "--input",
                "{tmp}/bad.txt",
                "--ratio",
                "0.1",
                "--out",
                "{tmp}/nodir/c",
            ],
            "does not exist",
        ),
        (
            "hi",
            [
                "compact",
                "--input",
                "{tmp}/bad.txt",
                "--ratio",
                "0.1",
                "--summarize",
                "--keep-last-tokens",
                "3",
                "--out",
                "{tmp}/c",
            ],
            "cannot be combined with --summarize",
        ),
        (
            "hi",
            [
                "compact",
                "--input",
                "{tmp}/bad.txt",
                "--ratio",
                "0.1",
                "--summarize",
                "--summary-tokens",
                "0",
                "--out",
                "{tmp}/c",
            ],
            "--summary-tokens must be >= 1",
        ),
        ("not a cache", ["inspect", "{tmp}/bad.txt"], "bad.txt"),
        (None, ["models", "prepare", "no-such-model"], "no-such-model"),
    ],
)
def test_bad_input_exits_2_with_one_sentence(tmp_path, capsys, setup, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    if setup is not None:
        path = next(a for a in args if "/bad." in a)
        with open(path, "w") as fh:
            fh.write(setup)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-compaction: error:") and message in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
