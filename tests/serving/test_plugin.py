"""The plugin entry point, version gate and prompt references (no engine started)."""

from __future__ import annotations

import logging

import pytest

from vllm_compaction.vllm import (
    CompactedRef,
    UnsupportedVLLMError,
    check_vllm_version,
    compacted_prompt,
    compat,
    plugin,
)


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    names = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "vllm_compaction.vllm.plugin:register" in names


def test_register_is_idempotent_and_wires_connector_and_backend(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()
    plugin.register()
    assert compat.connector_registered(plugin.CONNECTOR_NAME)
    assert AttentionBackendEnum.CPU_ATTN.get_path().endswith(
        "CompactionCPUAttentionBackend"
    )


def test_untested_vllm_version_is_refused_with_a_sentence(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_installed_vllm_version", lambda: "0.99.1")
    with pytest.raises(
        UnsupportedVLLMError, match="supports vLLM 0.32.0 but found 0.99.1"
    ):
        check_vllm_version()
    # the general plugin itself never raises: it logs and stays disabled
    monkeypatch.setattr(plugin, "_registered", False)
    with caplog.at_level(logging.WARNING):
        plugin.register()
    assert "stays disabled" in caplog.text


def test_compacted_ref_round_trip_and_malformed_salts():
    ref = CompactedRef("abc-1", 137, "0123456789abcdef0123456789abcdef")
    assert CompactedRef.parse(ref.salt) == ref
    assert CompactedRef.parse(None) is None and CompactedRef.parse("user-salt") is None
    # an older packing version
    for bad in (
        "vllm-compaction:1:a/b:3:" + "0" * 32,
        "vllm-compaction:2:a:3:" + "0" * 32,
        "vllm-compaction:1:a:x:" + "0" * 32,
        "vllm-compaction:2:varlen:a:3:" + "0" * 32,
    ):
        with pytest.raises(ValueError, match="malformed"):
            CompactedRef.parse(bad)


def test_text_continuation_needs_a_tokenizer(tiny_llama, tmp_path):
    from serving.engines import exact_cache

    cache = exact_cache(tiny_llama, list(range(5, 25)))
    with pytest.raises(ValueError, match="tokenizer"):
        compacted_prompt(cache, "hello", store=tmp_path)
    prompt = compacted_prompt(cache, [7, 8], store=tmp_path)
    assert prompt["prompt_token_ids"] == [0] * 20 + [7, 8]
    assert CompactedRef.parse(prompt["cache_salt"]).num_slots == 20


def test_two_caches_of_one_prefix_and_method_get_entries_of_their_own(
    tiny_llama, tmp_path
):
    """Same prefix and settings, other content (an edited or refitted cache): the second prompt
    must not be served the first one's entry."""
    import dataclasses

    from serving.engines import exact_cache

    cache = exact_cache(tiny_llama, list(range(5, 25)))
    edited = dataclasses.replace(
        cache,
        layers=[
            dataclasses.replace(layer, beta=layer.beta + 0.5) for layer in cache.layers
        ],
    )
    first = CompactedRef.parse(
        compacted_prompt(cache, [7, 8], store=tmp_path, block_size=16)["cache_salt"]
    )
    second = CompactedRef.parse(
        compacted_prompt(edited, [7, 8], store=tmp_path, block_size=16)["cache_salt"]
    )
    assert cache.fingerprint_key() == edited.fingerprint_key()
    assert first.entry_id != second.entry_id and first.digest != second.digest
    again = compacted_prompt(cache, [7, 8], store=tmp_path, block_size=16)
    assert CompactedRef.parse(again["cache_salt"]) == first


def test_unknown_page_width_is_refused_with_a_sentence(tmp_path):
    """Both ways in (our config helper, a hand-written --kv-transfer-config) give one sentence."""
    from vllm.config import KVTransferConfig, VllmConfig

    from vllm_compaction.vllm.backend_common import page_width
    from vllm_compaction.vllm.engine import kv_transfer_config

    with pytest.raises(
        ValueError, match="'pages' KV connector option must be one of stock, widened"
    ):
        kv_transfer_config(tmp_path, pages="narrow")
    config = kv_transfer_config(tmp_path)
    config["kv_connector_extra_config"]["pages"] = "narrow"
    with pytest.raises(
        ValueError, match="'pages' KV connector option must be one of stock, widened"
    ):
        page_width(VllmConfig(kv_transfer_config=KVTransferConfig(**config)))
    config["kv_connector_extra_config"]["pages"] = "widened"
    assert (
        page_width(VllmConfig(kv_transfer_config=KVTransferConfig(**config)))
        == "widened"
    )


def test_parallel_and_latent_engine_shapes_are_refused_with_a_sentence(monkeypatch):
    """Pipeline parallel engines, MLA models, chunked local attention and KV snapshots under
    tensor parallelism are refused before they serve anything; tensor parallelism is served."""
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    from vllm_compaction.models import resolve
    from vllm_compaction.vllm import engine_kwargs
    from vllm_compaction.vllm.connector import check_deployment_shape

    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    def engine_config(**kwargs):
        # Gemma-3-270M: 4 query heads and 1 KV head over 2 ranks (its KV head replicated)
        return EngineArgs(
            model=str(resolve("gemma3-270m")),
            tensor_parallel_size=2,
            dtype="float32",
            max_model_len=2048,
            **engine_kwargs(store="unused", **kwargs),
        ).create_engine_config()

    check_deployment_shape(engine_config())
    with pytest.raises(ValueError, match="snapshots under tensor parallelism"):
        check_deployment_shape(engine_config(kv_snapshots=True))

    def shape(**model):
        parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
        transfer = SimpleNamespace(kv_connector_extra_config={})
        return SimpleNamespace(
            parallel_config=parallel,
            model_config=SimpleNamespace(**model),
            kv_transfer_config=transfer,
        )

    check_deployment_shape(shape(use_mla=False, attention_chunk_size=None))
    with pytest.raises(ValueError, match="latent attention"):
        check_deployment_shape(shape(use_mla=True))
    with pytest.raises(ValueError, match="chunked local attention"):
        check_deployment_shape(shape(attention_chunk_size=8192))
    pipeline = shape()
    pipeline.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="pipeline parallelism"):
        check_deployment_shape(pipeline)
