"""Head sensitivity curves on tiny random models: a curve point is the loss change it claims to be
(measured independently), exact replay of the lower layers, base column zero, shapes,
non-compacted layers without curves."""

from __future__ import annotations

import pytest
import torch

from vllm_compaction.am import CompactedHeads
from vllm_compaction.models import PrefixLayer
from vllm_compaction.sensitivity import (
    LossContext,
    TargetLoss,
    head_sensitivity_curves,
    mixed_layer,
)


def _context(
    seed: int, length: int = 40, template: int = 4, target: int = 12
) -> LossContext:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (length,), generator=gen).tolist()
    mask = torch.ones(length, dtype=torch.bool)
    mask[:template] = False
    turn = [5, 6, 7]
    return LossContext(ids, mask, turn + ids[template : template + target], len(turn))


def test_loss_context_rejects_bad_input():
    with pytest.raises(ValueError, match="score_from"):
        LossContext([1, 2, 3], torch.tensor([False, True, True]), [4, 5], 0)
    with pytest.raises(ValueError, match="compact_mask"):
        LossContext([1, 2, 3], torch.tensor([True, True]), [4, 5], 1)


def test_replay_equals_full_forward(tiny_llama):
    ctx = _context(0)
    kv = tiny_llama.prefill(ctx.prefix_ids, capture_queries=False)
    base = kv.exact_prefix()
    runner = TargetLoss(tiny_llama, ctx, base)
    full = runner.baseline()
    manual = tiny_llama.forward(
        ctx.target_ids,
        torch.arange(40, 40 + len(ctx.target_ids)),
        prefix=base,
        logits_to_keep=len(ctx.target_ids),
    ).logits
    expected = torch.nn.functional.cross_entropy(
        manual[ctx.score_from - 1 : -1], torch.tensor(ctx.target_ids[ctx.score_from :])
    )
    assert full == pytest.approx(float(expected), abs=1e-5)
    positions = torch.arange(40)
    for layer in (1, 2):  # drop every other key of this layer only
        k, v = kv.keys[layer], kv.values[layer]
        short = PrefixLayer(
            k,
            v,
            torch.zeros(2, 40).index_fill_(1, torch.arange(0, 40, 2), float("-inf")),
            positions.expand(2, 40),
        )
        replayed = runner.loss(layer, short)
        assert replayed == pytest.approx(
            runner.loss(layer, short, replay=False), abs=1e-6
        )
        assert replayed != pytest.approx(full, abs=1e-6)
    # the model's layers are restored after replay
    assert runner.loss(1, base[1], replay=False) == pytest.approx(full, abs=1e-6)


def test_mixed_layer_takes_each_head_from_its_ratio():
    small = CompactedHeads.exact(
        torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.arange(3)
    )
    large = CompactedHeads.exact(
        torch.randn(2, 5, 4), torch.randn(2, 5, 4), torch.arange(5)
    )
    layer = mixed_layer([small, large], [1, 0])
    assert layer.keys.shape == (2, 5, 4)
    assert torch.equal(layer.keys[0], large.head(0)[0]) and torch.equal(
        layer.keys[1, :3], small.head(1)[0]
    )
    assert torch.isinf(layer.bias[1, 3:]).all() and (layer.bias[0] == 0).all()


def test_curves_on_tiny_llama(tiny_llama):
    contexts = [_context(1), _context(2)]
    curves = head_sensitivity_curves(
        tiny_llama,
        contexts,
        ratios=(0.0, 0.5, 1.0),
        base_ratio=0.25,
        queries="context-prefill",
        progress=False,
    )
    assert curves.curves.shape == (3 * 2, 4) and curves.std.shape == (6, 4)
    assert curves.ratios.tolist() == [0.0, 0.25, 0.5, 1.0]
    assert (curves.curves[:, 1] == 0).all() and curves.compactable.all()
    assert torch.isfinite(curves.curves).all() and curves.baseline.shape == (2,)
    assert (curves.curves[:, [0, 2, 3]] != 0).any()


def test_curves_skip_sliding_layers(tiny_gemma3):
    # default queries: repeat-prefill, on-policy; without a chat template the repeat prompt is the
    # loss target's own instruction turn
    curves = head_sensitivity_curves(
        tiny_gemma3, [_context(3)], ratios=(0.0, 1.0), base_ratio=0.1, progress=False
    )
    assert curves.compactable.tolist() == [False, False, True, False]
    assert (curves.curves[~curves.compactable] == 0).all()
    assert (curves.std == 0).all()


def test_bad_grid_and_method(tiny_llama):
    with pytest.raises(ValueError, match="base_ratio"):
        head_sensitivity_curves(
            tiny_llama, [_context(0)], base_ratio=0.0, progress=False
        )
    with pytest.raises(ValueError, match="unknown method"):
        head_sensitivity_curves(
            tiny_llama, [_context(0)], method="nope", progress=False
        )
    with pytest.raises(ValueError, match="at least one context"):
        head_sensitivity_curves(tiny_llama, [], progress=False)


def test_a_curve_point_is_the_loss_change_of_compacting_that_head_alone(tiny_llama):
    """On an exact cache (base ratio 1), the ratio-0 point of head h of layer l is the change in
    the target's NLL when that head loses every compacted token and nothing else changes,
    measured here by one plain forward; the ratio-1 point is 0 (the head stays exact)."""
    ctx = _context(1)
    curves = head_sensitivity_curves(
        tiny_llama,
        [ctx],
        ratios=(0.0, 1.0),
        base_ratio=1.0,
        queries="context-prefill",
        progress=False,
    )
    kv = tiny_llama.prefill(ctx.prefix_ids, capture_queries=False)
    length, target = len(ctx.prefix_ids), torch.tensor(ctx.target_ids)

    def nll(prefix: list[PrefixLayer]) -> float:
        logits = tiny_llama.forward(
            ctx.target_ids,
            torch.arange(length, length + len(target)),
            prefix=prefix,
            logits_to_keep=len(target),
        ).logits
        return float(
            torch.nn.functional.cross_entropy(
                logits[ctx.score_from - 1 : -1], target[ctx.score_from :]
            )
        )

    exact = kv.exact_prefix()
    baseline = nll(exact)
    heads = tiny_llama.num_kv_heads
    for layer in range(tiny_llama.num_layers):
        for h in range(heads):
            dropped = list(exact)
            bias = exact[layer].bias.clone()
            bias[h, ctx.compact_mask] = float("-inf")
            dropped[layer] = PrefixLayer(
                exact[layer].keys, exact[layer].values, bias, exact[layer].positions
            )
            assert float(curves.curves[layer * heads + h, 0]) == pytest.approx(
                nll(dropped) - baseline, abs=1e-5
            )
    assert (curves.curves[:, 1] == 0).all()
    # the heads matter: the check above is not 0 == 0
    assert curves.curves[:, 0].abs().max() > 1e-3
