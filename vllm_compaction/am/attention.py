"""Attention over key blocks: the one place where logits, attention mass and outputs are computed.

Conventions (paper, appendix "Attention Matching Details"): for a query ``q`` and a key block
``K`` the scaled logits are ``l = scale * q K^T (+ beta)``, the *mass* is ``sum_j exp(l_j)`` and
the locally normalised output is ``exp(l) V / mass``. Everything is computed in float32 (the
reference ``attention_output_and_mass`` also in float64, for oracles) with the per-query max
shift ``s = max_j l_j`` ("Stable computation"): the *shifted* features ``exp(l - s)`` and the
*shifted* mass ``sum_j exp(l_j - s)`` are what the fits use, and
``log mass = s + log(shifted mass)``.

All functions are batched over ``H`` KV heads (leading dimension) and process queries in
chunks sized for the device (:mod:`.device`): a few MiB of logits per head on a CPU, so that a
chunk stays in cache, and a share of the free memory on CUDA. On CUDA, ``reference_attention``
runs fused Triton kernels (``vllm_compaction_kernels.reference_attention``) that never hold the
``[n, T]`` logits at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vllm_compaction.am.device import device_limits
from vllm_compaction.am.heads import CompactedHeads

__all__ = [
    "AGGREGATIONS",
    "check_query_weights",
    "feature_storage",
    "AttentionResult",
    "OutputError",
    "ReferenceAttention",
    "attention_output_and_mass",
    "attention_output_error",
    "block_chunks",
    "bmm_row_split",
    "max_pool_scores",
    "query_chunks",
    "reference_attention",
    "repeat_heads",
    "resolve_scale",
    "row_split",
    "score_keys",
]

#: How attention weights over the reference queries become one score per key. ``weighted-max``
#: is ``max_i (w_i / max w) a_ij``: a query of weight ``w_i`` counts as an attention weight
#: ``w_i / max w`` times its own, so a low-weight source cannot dominate a ranking by its peaks
#: (a repeat of the context attends sharply to every key it copies); unweighted it is ``max``.
AGGREGATIONS = ("rms", "mean", "max", "weighted-max")
LN_2 = math.log(2.0)
TINY = torch.finfo(torch.float32).tiny
LOG2_E = 1.0 / LN_2
#: Fewest query rows per block when ``row_split`` cuts a head's chunk for thread balance.
MIN_SPLIT_ROWS = 64
#: How ``reference_attention`` runs: ``"auto"`` (the fused Triton kernels on CUDA with
#: ``FUSED_PRECISION``, torch elsewhere), ``"torch"``, or ``"triton:<precision>"`` (one of
#: ``ieee``, ``tf32``, ``tf32x3``, ``fp16``; on the CPU only under ``TRITON_INTERPRET=1``).
REFERENCE_BACKEND = "auto"
#: Input precision of the fused kernels' logits on CUDA. On an H100, 8 layers of the paper's
#: setting (8 heads, 60,000 keys, 40,000 fitting queries, d = 256) with ``am-highest-attn``:
#: reference pass 2.92 s with ``tf32``, 0.67 s with ``fp16`` operands (the same 10-bit
#: mantissas, twice the tensor-core rate, larger tiles), held-out output error 0.67452 and
#: 0.67455. On layer 0: ``tf32x3`` and exact fp32 (``ieee``) 0.69068, ``tf32`` 0.69059
#: (benchmarks/results/gpu_check.json): rounding the operands to 10 bits changes the fitted
#: caches' error by less than the run-to-run spread of the inputs.
FUSED_PRECISION = "fp16"
#: Storage of the kept feature matrix. Only OMP's correlation passes read it (each one a
#: memory-bound GEMV over all of it), to rank candidate keys; every fit uses fp32 features
#: recomputed from the keys. Half precision on the CPU (its fast GEMV). On CUDA (sm_89 and
#: later, under the fused pass) ``float8_e4m3fn`` of ``exp(l - s) * FP8_FEATURE_SCALE``: half
#: the bytes again, which halves OMP's selection on an H100 (each round reads 19 GB instead of
#: 38 GB at the paper's setting); ranking with fp8 features left the held-out error of
#: ``am-omp-fast`` where fp16 had it (0.6306 vs 0.6310 over 12 synthetic heads, T = 8,000,
#: 50x, the CPU emulating the rounding). The scale (a power of two) moves fp8's range onto
#: ``[0, 1]`` features: entries down to ``2^-17`` survive instead of ``2^-9``.
FEATURE_DTYPE = torch.float16
FP8_FEATURE_DTYPE = torch.float8_e4m3fn
FP8_FEATURE_SCALE = 256.0
#: ``"auto"`` (fp8 where the fused CUDA pass runs on sm_89+, fp16 elsewhere), ``"fp16"`` or
#: ``"fp8"`` (any device; the tests run the fp8 path on the CPU through the interpreter).
FEATURE_STORAGE = "auto"


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: ``scale`` if given (must be finite and > 0), else ``1/sqrt(d)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    return float(scale)


def check_query_weights(
    weights: torch.Tensor | None, queries: torch.Tensor
) -> torch.Tensor | None:
    """``[H, n]`` float32 weights scaled to a largest weight of 1 per head (a common factor
    changes no fit), or ``None``."""
    if weights is None:
        return None
    h, n, _ = queries.shape
    w = torch.as_tensor(weights, device=queries.device)
    if w.shape not in ((n,), (h, n)) or w.dtype == torch.bool or w.is_complex():
        raise ValueError(
            f"query_weights must be [n={n}] or [H={h}, n={n}] numbers, got {tuple(w.shape)} {w.dtype}"
        )
    w = w.float().expand(h, n)
    if n and not (torch.isfinite(w).all() and (w > 0).all()):
        raise ValueError("query_weights must be finite and positive")
    return w / w.amax(-1, keepdim=True) if n else w


def chunk_bytes_per_head(x: torch.Tensor) -> int:
    """Bytes of logits per head that a query-chunked pass over ``x [H, ...]`` holds at once on
    ``x``'s device (:func:`.device.device_limits`)."""
    return device_limits(x.device).chunk_bytes_per_head(x.shape[0])


def query_chunks(n: int, row_bytes: int, budget_bytes: int) -> list[slice]:
    """Slices of ``range(n)`` with at most ``budget_bytes // row_bytes`` rows each (>= 1)."""
    rows = max(1, budget_bytes // max(1, row_bytes))
    return [slice(a, min(n, a + rows)) for a in range(0, n, rows)]


def _shifted_exp_(
    logits: torch.Tensor, *, base2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn ``logits [H, c, T]`` *in place* into shifted features ``exp(l - s)`` (``2^(l - s)``
    with ``base2``, for logits in log2 units).

    Returns ``(features [H, c, T], shift [H, c, 1])``. Rows whose logits are all ``-inf``
    get shift 0 and features 0.
    """
    shift = logits.amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    logits.sub_(shift)
    return (logits.exp2_() if base2 else logits.exp_()), shift


@dataclass
class ReferenceAttention:
    """Statistics of the original attention of ``n`` reference queries over ``T`` keys.

    Attributes:
        shift: ``[H, n]`` fp32 per-query max logit ``s``.
        mass: ``[H, n]`` fp32 shifted mass ``sum_j exp(l_j - s)`` (in ``[1, T]``).
        output: ``[H, n, d]`` fp32 attention outputs ``Y`` (``None`` when not requested).
        scores: ``[H, T]`` fp32 aggregated attention weights per key (``None`` when not
            requested).
        features: ``[H, T, n]`` key-major shifted features ``Phi^T``, ``Phi = exp(l - s)``,
            times ``feature_scale``, in the dtype of ``feature_storage`` (``None`` when not
            requested; OMP ranks keys with them).
        feature_scale: the factor the stored features carry (1 in fp16).
    """

    shift: torch.Tensor
    mass: torch.Tensor
    output: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    features: torch.Tensor | None = None
    feature_scale: float = 1.0

    @property
    def log_mass(self) -> torch.Tensor:
        """``[H, n]`` log of the (unshifted) attention mass."""
        return self.shift + self.mass.log()

    def weighted_rows(self, row_scale: torch.Tensor) -> ReferenceAttention:
        """The same statistics with query ``i`` counted ``w_i = row_scale_i^2`` times by every
        least-squares fit over the shifted features and mass (the beta fit, OMP).

        A query's shift is arbitrary (its row of the fits is only defined up to it), so
        lowering it by ``log row_scale_i`` scales the row's shifted features and mass by
        ``row_scale_i``, which weighs its squared residual by ``w_i``: the same normal equations
        as ``w_i`` copies of the row. ``row_scale [H, n]`` in ``(0, 1]`` keeps the features in
        ``[0, 1]`` (the stored features' range). The kept feature matrix is scaled in place;
        outputs and scores are shared (the value fit normalises its rows, so it takes the
        scale itself, and the scores were weighted in the pass).
        """
        if self.features is not None:
            _scale_rows_(self.features, row_scale)
        return ReferenceAttention(
            shift=self.shift - row_scale.log(),
            mass=self.mass * row_scale,
            output=self.output,
            scores=self.scores,
            features=self.features,
            feature_scale=self.feature_scale,
        )


def _scale_rows_(features: torch.Tensor, row_scale: torch.Tensor) -> None:
    """``features [H, T, n] *= row_scale [H, 1, n]`` in place; fp8 has no arithmetic, so its
    blocks of keys are widened to fp16 one at a time."""
    if features.dtype != FP8_FEATURE_DTYPE:
        features.mul_(row_scale[:, None, :].to(features.dtype))
        return
    scale = row_scale[:, None, :].to(torch.float16)
    for start in range(0, features.shape[1], 4096):
        block = features[:, start : start + 4096]
        block.copy_(block.to(torch.float16).mul_(scale))


def feature_storage(device: torch.device) -> tuple[torch.dtype, float]:
    """``(dtype, scale)`` of the feature matrix a reference pass on ``device`` keeps."""
    storage = FEATURE_STORAGE
    if storage not in ("auto", "fp16", "fp8"):
        raise ValueError(f"FEATURE_STORAGE must be auto, fp16 or fp8, got {storage!r}")
    if storage == "auto":
        fp8 = (
            device.type == "cuda"
            and _fused_precision(device) is not None
            and torch.cuda.get_device_capability(device) >= (8, 9)
        )
        storage = "fp8" if fp8 else "fp16"
    if storage == "fp8":
        return FP8_FEATURE_DTYPE, FP8_FEATURE_SCALE
    return FEATURE_DTYPE, 1.0


def row_split(num_heads: int, rows: int, device: torch.device | str = "cpu") -> int:
    """Blocks to cut each head's rows into, so that a GEMM batched over heads has a multiple of
    the thread count of batch entries (1 when it already has, when blocks would be small, or
    off the CPU, where a batch of 3 keeps a GPU just as busy).

    CPU ``bmm`` spreads its batch entries over the threads: 3 KV heads (SmolLM2) on 2 threads
    leave one thread idle a third of the time. Cutting each head's query chunk in two (6 entries)
    took the reference pass on real SmolLM2 inputs from 66 to 49 ms per head on 2 cores.
    """
    if torch.device(device).type != "cpu":
        return 1
    threads = max(1, torch.get_num_threads())
    split = threads // math.gcd(max(1, num_heads), threads)
    return split if split > 1 and rows >= MIN_SPLIT_ROWS * split else 1


def block_chunks(
    n: int, rows: int, num_heads: int, device: torch.device | str
) -> tuple[list[slice], int]:
    """Chunks of ``range(n)`` of at most ``rows`` rows and their ``row_split``: every chunk but
    the last holds whole blocks, so the batched GEMMs of ``bmm_row_split`` can cut it."""
    split = row_split(num_heads, rows, device)
    return query_chunks(n, 1, max(1, rows // split * split)), split


def repeat_heads(b: torch.Tensor, split: int) -> torch.Tensor:
    """``b [H, k, m]`` with every head repeated ``split`` times (the right operand of
    ``bmm_row_split``)."""
    return b.repeat_interleave(split, 0) if split > 1 else b


def bmm_row_split(
    a: torch.Tensor, b_rep: torch.Tensor, split: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``bmm(a [H, c, k], b [H, k, m]) -> [H, c, m]`` with ``a``'s rows cut into ``split``
    blocks (``row_split``), ``b_rep = repeat_heads(b, split)``; a chunk whose rows ``split``
    does not divide is multiplied whole. ``out``: flat storage of at least ``H c m`` elements."""
    h, c, _ = a.shape
    if split > 1 and c % split:
        b_rep, split = b_rep[::split], 1
    a = a.reshape(h * split, c // split, -1)
    m = b_rep.shape[-1]
    target = None if out is None else out[: h * c * m].view(h * split, c // split, m)
    return torch.bmm(a, b_rep, out=target).view(h, c, m)


def reference_attention(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    queries: torch.Tensor,
    *,
    scale: float,
    aggregation: str | None = None,
    keep_features: bool = False,
    query_weights: torch.Tensor | None = None,
) -> ReferenceAttention:
    """One chunked pass of the original attention: mass, outputs, key scores, features.

    Per query chunk: logits ``[H, c, T]`` by one GEMM, shifted exp in place, then one GEMM
    with ``V`` for ``P V`` and a row sum for the shifted mass ``P 1``; key scores are GEMVs of
    ``P`` (or ``P * P``) with the per-query weights ``1/m`` (or ``1/m^2``). The GEMMs cut each
    head's rows into ``row_split`` blocks.

    Parameters
    ----------
    keys : ``[H, T, d]`` float32 keys.
    values : ``[H, T, d]`` float32 values, or ``None`` to skip the outputs.
    queries : ``[H, n, d]`` float32 reference queries.
    scale : softmax scale.
    aggregation : ``"rms" | "mean" | "max" | "weighted-max"`` aggregation of the attention
        weights ``softmax(l)`` over queries into per-key scores, or ``None`` to skip scoring.
    keep_features : keep the whole shifted-feature matrix, key-major ``[H, T, n]``, stored
        as ``feature_storage(device)`` says.
    query_weights : ``[H, n]`` positive weight of each query in the ``rms`` and ``mean``
        scores (a weighted mean over queries, as if query ``i`` were there ``w_i`` times) and
        the ``weighted-max`` (scaled by the head's largest weight); ``None`` weighs every query
        1. A ``max`` ignores them, as a repeated row leaves a max unchanged.
    """
    if aggregation is not None and aggregation not in AGGREGATIONS:
        raise ValueError(
            f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}"
        )
    precision = _fused_precision(keys.device)
    if precision is not None:
        return _fused_reference(
            keys,
            values,
            queries,
            scale,
            aggregation,
            keep_features,
            query_weights,
            precision,
        )
    h, t, d = keys.shape
    n = queries.shape[1]
    # Logits in log2 units: exp(l - s) = 2^((l - s) log2 e), and exp2 costs ~40% less than exp
    # on the CPU (0.52 vs 0.89 ms per [3, 265, 1976] chunk here); the shift is converted back.
    kt, qs = keys.transpose(1, 2), queries * (scale * LOG2_E)  # [H, d, T], [H, n, d]
    shift, mass = keys.new_empty(h, n), keys.new_empty(h, n)
    output = keys.new_empty(h, n, values.shape[-1]) if values is not None else None
    feature_dtype, feature_scale = feature_storage(keys.device)
    features = keys.new_empty(h, t, n, dtype=feature_dtype) if keep_features else None
    chunks, split = block_chunks(
        n, min(n, max(1, chunk_bytes_per_head(keys) // (4 * t))), h, keys.device
    )
    rows = chunks[0].stop - chunks[0].start if chunks else 0
    # keys and values repeated once per row block: tiny next to the logits
    kt_rep = repeat_heads(kt, split)
    v_rep = repeat_heads(values, split) if values is not None else None
    # the rms and mean scores' weights (None: every query counts once)
    mean_weights = query_weights if aggregation in ("rms", "mean") else None
    max_weights = None
    if query_weights is not None and aggregation == "weighted-max":
        max_weights = query_weights / query_weights.amax(-1, keepdim=True).clamp_min(
            TINY
        )
    acc = keys.new_zeros(h, split, t)  # score accumulators, one per row block
    scratch = keys.new_empty(h * rows * t)
    for sl in chunks:
        c = sl.stop - sl.start
        p, s = _shifted_exp_(
            bmm_row_split(qs[:, sl], kt_rep, split, out=scratch), base2=True
        )
        m = p.sum(-1, keepdim=True)  # [H, c, 1] shifted mass
        shift[:, sl], mass[:, sl] = s[..., 0] * LN_2, m[..., 0]
        # key-major, so that OMP's correlation is a fast half GEMV
        if features is not None:
            features[:, :, sl] = (
                p.transpose(1, 2)
                if feature_scale == 1.0
                else p.transpose(1, 2) * feature_scale
            )
        inv_m = m.reciprocal()  # [H, c, 1]
        if output is not None and v_rep is not None:  # both there with the values
            torch.mul(bmm_row_split(p, v_rep, split), inv_m, out=output[:, sl])
        if aggregation in ("max", "weighted-max"):
            p.mul_(inv_m if max_weights is None else inv_m * max_weights[:, sl, None])
            torch.maximum(acc[:, :1], p.amax(1, keepdim=True), out=acc[:, :1])
        elif aggregation is not None:
            weight, p = (
                (inv_m, p) if aggregation == "mean" else (inv_m.square(), p.square_())
            )
            if mean_weights is not None:
                weight = weight * mean_weights[:, sl, None]
            # the per-block GEMVs are balanced too
            blocks = split if c % split == 0 else 1
            acc_view = acc.view(h * split, 1, t) if blocks > 1 else acc[:, :1]
            acc_view.baddbmm_(
                weight.reshape(h * blocks, 1, c // blocks),
                p.view(h * blocks, c // blocks, t),
            )
    scores = acc.sum(1)
    count = (
        mean_weights.sum(1, keepdim=True).float().clamp_min(TINY)
        if mean_weights is not None
        else max(n, 1)
    )
    if aggregation == "rms":
        scores = scores.div_(count).sqrt_()
    elif aggregation == "mean":
        scores = scores.div_(count)
    return ReferenceAttention(
        shift=shift,
        mass=mass,
        output=output,
        scores=scores if aggregation else None,
        features=features,
        feature_scale=feature_scale if features is not None else 1.0,
    )


def _fused_precision(device: torch.device) -> str | None:
    """The fused kernels' precision for a pass on ``device`` under ``REFERENCE_BACKEND``, or
    ``None`` for the torch pass."""
    backend = REFERENCE_BACKEND
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return None
    if backend == "auto":
        try:
            import triton  # noqa: F401
        except ImportError:
            return None
        return FUSED_PRECISION
    name, _, precision = backend.partition(":")
    if name != "triton" or not precision:
        raise ValueError(
            f"REFERENCE_BACKEND must be auto, torch or triton:<precision>, got {backend!r}"
        )
    return precision


def _fused_reference(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    queries: torch.Tensor,
    scale: float,
    aggregation: str | None,
    keep_features: bool,
    query_weights: torch.Tensor | None,
    precision: str,
) -> ReferenceAttention:
    """``reference_attention`` by the fused Triton kernels: the same statistics, the scores
    normalised as the torch pass normalises them."""
    from vllm_compaction_kernels.reference_attention import reference_attention_triton

    n = queries.shape[1]
    weighted = query_weights is not None and aggregation in ("rms", "mean")
    row_weights = query_weights if weighted else None
    if query_weights is not None and aggregation == "weighted-max":
        row_weights = query_weights / query_weights.amax(-1, keepdim=True).clamp_min(
            TINY
        )
    feature_dtype, feature_scale = feature_storage(keys.device)
    stats = reference_attention_triton(
        keys,
        values,
        queries,
        scale=scale,
        aggregation=aggregation,
        keep_features=keep_features,
        row_weights=row_weights,
        precision=precision,
        feature_dtype=feature_dtype,
        feature_scale=feature_scale,
    )
    scores = stats.scores
    if aggregation in ("rms", "mean"):
        count = (
            query_weights.sum(1, keepdim=True).float().clamp_min(TINY)
            if query_weights is not None  # weighted, under rms and mean
            else max(n, 1)
        )
        scores = scores.div_(count)
        if aggregation == "rms":
            scores = scores.sqrt_()
    return ReferenceAttention(
        shift=stats.shift,
        mass=stats.mass,
        output=stats.output,
        scores=scores,
        features=stats.features,
        feature_scale=stats.feature_scale,
    )


def max_pool_scores(scores: torch.Tensor, kernel: int | None) -> torch.Tensor:
    """SnapKV-style max pooling of ``scores [H, T]`` along T (odd ``kernel``, same length)."""
    if kernel is None or kernel <= 1:
        return scores
    return F.max_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]


def score_keys(
    keys: torch.Tensor,
    queries: torch.Tensor,
    *,
    scale: float | None = None,
    aggregation: str = "rms",
    pool_kernel: int | None = None,
    query_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-key importance: attention weights aggregated over queries, optionally max-pooled.

    Parameters
    ----------
    keys : ``[H, T, d]`` post-RoPE keys (any float dtype).
    queries : ``[H, n, d]`` reference queries (all query heads of a GQA group pooled).
    scale : softmax scale, default ``1/sqrt(d)``.
    aggregation : ``"rms"`` (AM), ``"mean"`` (H2O, SnapKV), ``"max"`` (KVzip) or
        ``"weighted-max"`` (KVzip's max with each query's attention scaled by its weight).
    pool_kernel : odd max-pooling kernel along T (SnapKV uses 7), or ``None``.
    query_weights : ``[n]`` or ``[H, n]`` positive weights of the queries (``reference_attention``).

    Returns
    -------
    ``[H, T]`` float32 scores; comparable across heads and layers (each is a softmax weight
    statistic in ``[0, 1]``), which is what global (KVzip) budgets rank.
    """
    if (
        keys.dim() != 3
        or queries.dim() != 3
        or keys.shape[0] != queries.shape[0]
        or keys.shape[2] != queries.shape[2]
    ):
        raise ValueError(
            f"keys must be [H, T, d] and queries [H, n, d], got {tuple(keys.shape)} and {tuple(queries.shape)}"
        )
    if queries.shape[1] == 0:
        raise ValueError("scoring keys needs at least one query per head")
    if pool_kernel is not None and (pool_kernel < 1 or pool_kernel % 2 == 0):
        raise ValueError(
            f"pool_kernel must be a positive odd integer, got {pool_kernel}"
        )
    weights = check_query_weights(query_weights, queries)
    ref = reference_attention(
        keys.float(),
        None,
        queries.float(),
        scale=resolve_scale(scale, keys.shape[-1]),
        aggregation=aggregation,
        query_weights=weights,
    )
    scores: torch.Tensor = ref.scores  # type: ignore[assignment]  # set since aggregation is given
    return max_pool_scores(scores, pool_kernel)


class AttentionResult(NamedTuple):
    """Attention of queries over one key block.

    Attributes:
        output: ``[H, n, d]`` locally normalised attention output (0 for an empty block).
        log_mass: ``[H, n]`` log attention mass (``-inf`` for an empty block).
    """

    output: torch.Tensor
    log_mass: torch.Tensor


def attention_output_and_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float | None = None,
    beta: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> AttentionResult:
    """Reference biased attention ``softmax(scale * q K^T + beta) V`` and its log mass.

    This is the float reference every other attention of the package is tested against (the
    reference decoder's runtime, the kernels' torch twin, the fitting pass
    ``reference_attention``): plain GEMMs and a max-shifted softmax, nothing fused, so that a
    disagreement points at the optimised implementation.

    Parameters
    ----------
    queries : ``[H, n, d]``.
    keys, values : ``[H, t, d]`` (padded slots allowed, with ``beta = -inf``).
    scale : softmax scale, default ``1/sqrt(d)``.
    beta : ``[H, t]`` per-slot logit bias (``-inf`` masks a slot), default 0.
    dtype : the dtype of the computation and of the result: float32 (the fits' precision),
        or float64 for an oracle whose own rounding must not hide a 1e-6 disagreement.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    if keys.shape != values.shape or keys.dim() != 3 or queries.dim() != 3:
        raise ValueError(
            f"keys/values must be equal [H, t, d], got {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    if queries.shape[0] != keys.shape[0] or queries.shape[2] != keys.shape[2]:
        raise ValueError(
            f"queries {tuple(queries.shape)} do not match keys {tuple(keys.shape)}"
        )
    h, t, d = keys.shape
    n = queries.shape[1]
    qs = queries.to(dtype) * resolve_scale(scale, d)
    kt, v = keys.to(dtype).transpose(1, 2), values.to(dtype)
    bias = None if beta is None else beta.to(dtype).reshape(h, 1, t)
    output = qs.new_zeros(h, n, d)
    log_mass = qs.new_full((h, n), float("-inf"))
    if t == 0:
        return AttentionResult(output, log_mass)
    tiny = torch.finfo(dtype).tiny
    for sl in query_chunks(n, qs.element_size() * t, chunk_bytes_per_head(keys)):
        logits = torch.bmm(qs[:, sl], kt)
        if bias is not None:
            logits += bias
        p, s = _shifted_exp_(logits)
        m = p.sum(-1, keepdim=True)
        output[:, sl] = torch.bmm(p, v) / m.clamp_min(tiny)
        log_mass[:, sl] = (s + m.log())[..., 0]
    return AttentionResult(output, log_mass)


@dataclass
class OutputError:
    """Per-head errors of a compacted block against the original one, over some queries.

    Attributes:
        output_rel: ``[H]`` relative output error ``||Y_hat - Y||_F / ||Y||_F``.
        mass_rel: ``[H]`` mean over queries of ``|mass_hat / mass - 1|``.
        log_mass_abs: ``[H]`` mean over queries of ``|log mass_hat - log mass|``.
    """

    output_rel: torch.Tensor
    mass_rel: torch.Tensor
    log_mass_abs: torch.Tensor


def attention_output_error(
    heads: CompactedHeads,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    *,
    scale: float | None = None,
) -> OutputError:
    """Errors of compacted ``heads`` against the original ``keys``/``values [H, T, d]`` under
    ``queries [H, n, d]`` (use held-out queries to measure generalisation)."""
    if heads.num_heads != keys.shape[0]:
        raise ValueError(
            f"heads has {heads.num_heads} heads but keys has {keys.shape[0]}"
        )
    ref = attention_output_and_mass(queries, keys, values, scale=scale)
    ck, cbeta, cv, _ = heads.padded()
    got = attention_output_and_mass(queries, ck, cv, scale=scale, beta=cbeta)
    out_rel = torch.linalg.vector_norm(
        got.output - ref.output, dim=(1, 2)
    ) / torch.linalg.vector_norm(ref.output, dim=(1, 2)).clamp_min(1e-30)
    diff = got.log_mass - ref.log_mass
    return OutputError(
        output_rel=out_rel,
        mass_rel=torch.expm1(diff).abs().mean(1),
        log_mass_abs=diff.abs().mean(1),
    )
