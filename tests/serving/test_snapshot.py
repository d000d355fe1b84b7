"""KV snapshots without an engine: the scheduler's per-step plans and the worker's recorder.

The engine tests (``test_engine.py``, ``test_engine_bf16.py``) take real snapshots; these pin the
bookkeeping in between: chunked prefills, shuffled write order, refusals.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")

from vllm_compaction.vllm.connector import _SchedulerSide  # noqa: E402
from vllm_compaction.vllm.snapshot import SNAPSHOT_PARAM, SnapshotPlan, SnapshotRecorder  # noqa: E402

BLOCK = 4


def _request(req_id: str, length: int, name: str | None) -> SimpleNamespace:
    params = {SNAPSHOT_PARAM: name} if name is not None else None
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params=params,
        num_prompt_tokens=length,
        cache_salt=None,
        prompt_token_ids=list(range(length)),
    )


def _step(new=(), cached=(), scheduled=None) -> SimpleNamespace:
    """A SchedulerOutput with the fields the connector reads: ``new`` holds (req, blocks, computed),
    ``cached`` (req, new blocks, computed, resumed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
            for r, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached],
            new_block_ids=[(b,) if b else None for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
            resumed_req_ids={r for r, _, _, res in cached if res},
        ),
        num_scheduled_tokens=scheduled or {},
    )


def test_chunked_prefill_is_planned_step_by_step_with_its_slots():
    scheduler = _SchedulerSide(BLOCK, snapshots=True)
    # nothing claimed
    assert scheduler.num_new_matched(_request("a", 10, "snap-a"), 0) == 0
    first = scheduler.take_metadata(
        _step(new=[("a", [7, 3], 0)], scheduled={"a": 6})
    ).snapshots
    assert [(p.name, p.start, p.end, p.final) for p in first] == [
        ("snap-a", 0, 6, False)
    ]
    assert first[0].slots == [28, 29, 30, 31, 12, 13]
    second = scheduler.take_metadata(
        _step(cached=[("a", [5], 6, False)], scheduled={"a": 4})
    ).snapshots
    assert [(p.start, p.end, p.final) for p in second] == [(6, 10, True)]
    assert second[0].slots == [14, 15, 20, 21]
    # the prompt is complete: decode steps plan nothing more
    assert (
        scheduler.take_metadata(
            _step(cached=[("a", None, 10, False)], scheduled={"a": 1})
        ).snapshots
        == []
    )


def test_a_request_that_ends_mid_prompt_has_its_rows_dropped(tmp_path):
    scheduler = _SchedulerSide(BLOCK, snapshots=True)
    scheduler.num_new_matched(_request("a", 10, "snap-a"), 0)
    (plan,) = scheduler.take_metadata(
        _step(new=[("a", [7, 3], 0)], scheduled={"a": 6})
    ).snapshots
    recorder = SnapshotRecorder(tmp_path, 1)
    recorder.begin_step([plan])
    recorder.record(
        0, torch.ones(6, 1, 2), torch.ones(6, 1, 2), torch.tensor(plan.slots)
    )
    recorder.finish_step()
    assert recorder.pending == ["snap-a"]
    scheduler.forget("a")  # aborted after the first chunk
    metadata = scheduler.take_metadata(_step())
    assert metadata.abandoned_snapshots == ["snap-a"] and metadata.snapshots == []
    recorder.drop(metadata.abandoned_snapshots)
    assert recorder.pending == [] and not list(tmp_path.iterdir())
    assert scheduler.take_metadata(_step()).abandoned_snapshots == []  # said once


def test_snapshots_are_refused_when_off_misnamed_or_partly_cached(caplog):
    off = _SchedulerSide(BLOCK, snapshots=False)
    off.num_new_matched(_request("a", 8, "snap"), 0)
    assert (
        off.take_metadata(_step(new=[("a", [1, 2], 0)], scheduled={"a": 8})).snapshots
        == []
    )
    assert "not started with kv_snapshots" in caplog.text

    on = _SchedulerSide(BLOCK, snapshots=True)
    on.num_new_matched(_request("b", 8, "../../etc/passwd"), 0)
    # half the prompt came from the prefix cache
    on.num_new_matched(_request("c", 8, "snap-c"), 4)
    assert (
        on.take_metadata(
            _step(new=[("b", [1, 2], 0), ("c", [3, 4], 4)], scheduled={"b": 8, "c": 4})
        ).snapshots
        == []
    )
    assert (
        "must be 1-64 letters" in caplog.text
        and "came from the prefix cache" in caplog.text
    )


def test_recorder_reassembles_rows_written_in_any_order(tmp_path):
    torch.manual_seed(0)
    layers, heads, dim, length = 2, 3, 4, 10
    keys, values = (
        torch.randn(layers, heads, length, dim),
        torch.randn(layers, heads, length, dim),
    )
    slots = torch.tensor([28, 29, 30, 31, 12, 13, 14, 15, 20, 21])  # position -> slot
    recorder = SnapshotRecorder(tmp_path, layers)
    for start, end in ((0, 6), (6, 10)):
        plan = SnapshotPlan("snap", start, end, slots[start:end].tolist(), length)
        recorder.begin_step([plan])
        for layer in range(layers):
            # the batch holds another request's rows too, and this one's in shuffled order
            order = torch.randperm(end - start) + start
            written = torch.cat([torch.tensor([99, 98]), slots[order]])
            other = torch.randn(2, heads, dim)
            recorder.record(
                layer,
                torch.cat([other, keys[layer, :, order].transpose(0, 1)]),
                torch.cat([other, values[layer, :, order].transpose(0, 1)]),
                written,
            )
        recorder.finish_step()
        assert (tmp_path / "snap.safetensors").is_file() == plan.final
    saved = load_file(str(tmp_path / "snap.safetensors"))
    assert torch.equal(saved["keys"], keys) and torch.equal(saved["values"], values)
    assert not list(tmp_path.glob("*.partial"))
