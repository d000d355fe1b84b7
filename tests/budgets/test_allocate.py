"""Head budgets: exact totals, global selection, caps/floors water-filling, schedules."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_compaction.budgets import (
    Schedule,
    cap_and_fill,
    global_budgets,
    pyramid_budgets,
    resolve_budgets,
    shares_to_budgets,
    uniform_budgets,
)

LAYERS = torch.tensor([True, False, True, True])


def test_uniform_total_and_spread():
    b = uniform_budgets(0.1, 1000, LAYERS, 3)
    assert int(b.sum()) == round(0.1 * 1000 * 9)
    assert (b[1] == 0).all() and int(b[LAYERS].max() - b[LAYERS].min()) <= 1


def test_global_budgets_follow_scores():
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(3, 100, generator=g) for _ in range(4)]
    scores[1] = None
    scores[2][1] += 10.0  # one head dominates: it takes everything it can
    b = global_budgets(scores, 0.2, 100)
    assert int(b.sum()) == 180 and b[2, 1] == 100 and (b[1] == 0).all()


def test_layer_floor_gives_every_layer_its_share_then_ranks_globally():
    """``min_layer_share=s``: each compacted layer first keeps its own top ``s`` of an equal
    split (by its scores, so the layer's strongest head gets them), then the rest is global."""
    g = torch.Generator().manual_seed(1)
    scores = [torch.rand(3, 100, generator=g) for _ in range(4)]
    scores[1] = None
    scores[3] *= 0.01  # a layer global ranking starves: 0 slots without a floor
    scores[3][2, :7] = 0.5  # ... whose head 2 has its 7 strongest keys
    assert global_budgets(scores, 0.2, 100)[3].sum() == 0
    assert torch.equal(
        global_budgets(scores, 0.2, 100, min_layer_share=0.0),
        global_budgets(scores, 0.2, 100),
    )
    # total 180, floor 30 per layer
    b = global_budgets(scores, 0.2, 100, min_layer_share=0.5)
    assert int(b.sum()) == 180 and (b[1] == 0).all()
    assert (
        int(b[3].sum()) == 30
        and b[3, 2] >= 7
        and int(b[0].sum()) >= 30
        and int(b[2].sum()) >= 30
    )
    equal = global_budgets(scores, 0.2, 100, min_layer_share=1.0)
    assert [int(x) for x in equal.sum(1)] == [60, 0, 60, 60]
    for bad in (1.5, -0.1, float("nan"), "half", True):
        with pytest.raises(ValueError, match="min_layer_share"):
            global_budgets(scores, 0.2, 100, min_layer_share=bad)
    with pytest.raises(ValueError, match="global"):
        resolve_budgets(
            "uniform",
            ratio=0.1,
            n=100,
            layers=LAYERS,
            num_heads=3,
            scores=lambda: scores,
            min_layer_share=0.5,
        )


def test_pyramid_decreases_with_depth():
    b = pyramid_budgets(0.1, 1000, torch.ones(6, dtype=torch.bool), 2)
    assert int(b.sum()) == 1200
    per_layer = b.sum(1)
    assert all(per_layer[i] >= per_layer[i + 1] for i in range(5))


def test_cap_water_fills_excess_to_other_heads():
    budgets = torch.tensor([[90, 5, 5], [0, 0, 0]])
    layers = torch.tensor([True, False])
    out = cap_and_fill(budgets, 100, layers, max_head_ratio=0.5)
    assert int(out.sum()) == 100 and int(out.max()) <= 50 and (out[1] == 0).all()
    floored = cap_and_fill(
        torch.tensor([[100, 0, 0]]), 100, torch.tensor([True]), min_head_slots=10
    )
    assert int(floored.sum()) == 100 and int(floored.min()) >= 10


def test_shares_and_schedule_files(tmp_path):
    shares = torch.tensor([[0.5, 0.25], [0.0, 0.0], [0.25, 0.0]])
    layers = torch.tensor([True, False, True])
    b = shares_to_budgets(shares, 0.1, 200, layers)
    assert int(b.sum()) == 80 and b[0, 0] == 40
    sched = Schedule(model="m", num_layers=3, num_kv_heads=2, shares=shares.tolist())
    path = sched.save(tmp_path / "s.json")
    b2 = resolve_budgets(
        str(path), ratio=0.1, n=200, layers=layers, num_heads=2, scores=lambda: []
    )
    assert torch.equal(b, b2)


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="ratio"):
        uniform_budgets(0.0, 10, LAYERS, 2)
    with pytest.raises(ValueError, match="sum to 1"):
        Schedule(model="m", num_layers=1, num_kv_heads=2, shares=[[0.2, 0.2]])
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {"model": "m", "num_layers": 2, "num_kv_heads": 1, "shares": [[1.0], [0.0]]}
        )
    )
    with pytest.raises(ValueError, match="layers"):
        resolve_budgets(
            str(bad), ratio=0.1, n=10, layers=LAYERS, num_heads=2, scores=lambda: []
        )
    with pytest.raises(ValueError, match="unknown budgets"):
        resolve_budgets(
            "nope", ratio=0.1, n=10, layers=LAYERS, num_heads=2, scores=lambda: []
        )
