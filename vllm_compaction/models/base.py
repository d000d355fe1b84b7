"""ModelAdapter: a stock HF causal LM seen through the attention runtime.

The adapter never copies modeling code: it switches the model to the runtime attention
function (``runtime.py``) and drives forward passes with explicit positions, segments and
per-layer prefixes. Subclasses only declare which layers are compactable and which RoPE
variants are safe to re-base.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from vllm_compaction.cache.format import ModelFingerprint
from vllm_compaction.models import runtime
from vllm_compaction.models.chat import ChatTemplateError, ChatTokenizer
from vllm_compaction.models.fingerprint import checkpoint_fingerprint
from vllm_compaction.models.rope import layer_windows
from vllm_compaction.models.runtime import AttentionRun, PrefixLayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["ModelAdapter", "PrefixKV", "ForwardResult", "UnsupportedModelError"]

logger = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The model's architecture or position encoding cannot be compacted safely."""


@dataclass
class PrefixKV:
    """Post-RoPE keys/values (and optionally pooled queries) of a prefix.

    Attributes:
        token_ids: ``[T]`` int64.
        keys, values: per layer ``[H_kv, T, d]`` in the model dtype.
        queries: per layer ``[H_kv, G*T, d]`` (query heads of each GQA group pooled), or None.
        last_hidden: ``[T, hidden]`` final hidden states (what the logits are computed from), or None.
    """

    token_ids: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor] | None = None
    last_hidden: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    def exact_prefix(self) -> list[PrefixLayer]:
        positions = torch.arange(self.length, device=self.keys[0].device)
        return [
            PrefixLayer.exact(k, v, positions) for k, v in zip(self.keys, self.values)
        ]


@dataclass
class ForwardResult:
    logits: torch.Tensor | None  # [L_kept, vocab] float32
    run: AttentionRun
    hidden: torch.Tensor | None = (
        None  # [L, hidden] final hidden states, when no logits were asked for
    )


class ModelAdapter:
    """Base adapter for decoder-only HF models using transformers' attention interface."""

    architectures: ClassVar[tuple[str, ...]] = ()
    # RoPE variants for which rotating keys by a constant re-bases them exactly (rope_type).
    rebasable_rope: ClassVar[tuple[str, ...]] = ("default", "linear", "llama3", "yarn")

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        path: Path | None = None,
        name: str = "",
    ):
        runtime.install()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat = ChatTokenizer(tokenizer)
        self.path = Path(path) if path is not None else None
        self.name = name
        self.config = (
            model.config.get_text_config()
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        model.config._attn_implementation = runtime.ATTN_IMPLEMENTATION
        self.config._attn_implementation = runtime.ATTN_IMPLEMENTATION
        self._check_rope()
        self._fingerprint: ModelFingerprint | None = None

    # ------------------------------------------------------------------ model facts
    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def num_q_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(
            getattr(self.config, "num_key_value_heads", None) or self.num_q_heads
        )

    @property
    def head_dim(self) -> int:
        return int(
            getattr(self.config, "head_dim", None)
            or self.config.hidden_size // self.num_q_heads
        )

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Where the weights are: every forward pass, query and fit of a compaction runs there."""
        return next(self.model.parameters()).device

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer ``"global"`` or ``"sliding"``."""
        types = getattr(self.config, "layer_types", None)
        if not types:
            return ["global"] * self.num_layers
        return ["sliding" if t == "sliding_attention" else "global" for t in types]

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer its sliding window (keys a query sees, itself included), None if global."""
        return layer_windows(self.config)

    @property
    def compactable_layers(self) -> list[bool]:
        """Sliding-window layers keep their exact (short-range) KV; global layers compact."""
        return [kind == "global" for kind in self.layer_kinds]

    def layer_scales(self) -> list[float]:
        """Softmax scale of each layer's attention (what AM must fit with)."""
        # torch types a Module's attributes Tensor | Module; an HF attention's scaling is a float
        return [float(m.scaling) for m in self._attention_modules()]  # type: ignore[arg-type]

    def _attention_modules(self) -> list[torch.nn.Module]:
        mods = [
            m
            for m in self.model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "scaling")
        ]
        mods.sort(key=lambda m: m.layer_idx)
        if len(mods) != self.num_layers:
            raise UnsupportedModelError(
                f"found {len(mods)} attention modules with a layer_idx, expected {self.num_layers}"
            )
        return mods

    def _check_rope(self) -> None:
        rope = (
            getattr(self.config, "rope_scaling", None)
            or getattr(self.config, "rope_parameters", None)
            or {}
        )
        kinds = (
            {rope.get("rope_type", rope.get("type", "default"))}
            if isinstance(rope, dict)
            else {"default"}
        )
        if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):
            kinds = {
                v.get("rope_type", "default")
                for v in rope.values()
                if isinstance(v, dict)
            }
        # the config's RoPE type names (untyped config data)
        bad = cast(set[str], kinds - set(self.rebasable_rope))
        if bad:
            raise UnsupportedModelError(
                f"RoPE type(s) {sorted(bad)} cannot be re-based by a constant rotation; supported: "
                f"{list(self.rebasable_rope)}"
            )

    def fingerprint(self) -> ModelFingerprint:
        if (
            self._fingerprint is None
            and self.path is not None
            and (Path(self.path) / "config.json").is_file()
        ):
            # from the files, so the serving engine (which loads the same folder) agrees
            self._fingerprint = checkpoint_fingerprint(
                self.path, dtype=str(self.dtype).removeprefix("torch."), name=self.name
            )
        if self._fingerprint is None:
            cfg = json.dumps(self.config.to_dict(), sort_keys=True, default=str)
            weights = hashlib.sha256()
            for name, tensor in sorted(self.model.state_dict().items()):
                weights.update(name.encode())
                flat = tensor.detach().contiguous().view(-1)
                # digest a strided sample: fast, still changes with any re-trained weight
                weights.update(
                    flat[:: max(1, flat.numel() // 4096)]
                    .float()
                    .cpu()
                    .numpy()
                    .tobytes()
                )
            self._fingerprint = ModelFingerprint(
                architecture=(self.config.architectures or [type(self.model).__name__])[
                    0
                ],
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads,
                num_q_heads=self.num_q_heads,
                head_dim=self.head_dim,
                config_digest=hashlib.sha256(cfg.encode()).hexdigest(),
                weights_digest=weights.hexdigest(),
                dtype=str(self.dtype).removeprefix("torch."),
                name=self.name,
            )
        return self._fingerprint

    # ------------------------------------------------------------------ tokens (see .chat)
    @property
    def has_chat_template(self) -> bool:
        return self.chat.has_chat_template

    def render(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = False
    ) -> str:
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt)

    def chat_ids(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = False
    ) -> list[int]:
        return self.chat.chat_ids(messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Plain text -> token ids, without special tokens."""
        return self.chat.encode(text)

    def turn_ids(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` continuing an existing conversation (see ``ChatTokenizer``)."""
        return self._chat_call(
            self.chat.turn_ids, messages, add_generation_prompt=add_generation_prompt
        )

    def chat_content(self, messages: Sequence[dict]) -> tuple[list[int], torch.Tensor]:
        """Token ids of a conversation and a ``[T]`` bool mask of its message-content tokens."""
        return self._chat_call(self.chat.chat_content, messages)

    def continuation_ids(self, continuation) -> list[int]:
        """Text, token ids or chat messages following a prefix, as token ids."""
        return self._chat_call(self.chat.continuation_ids, continuation)

    @staticmethod
    def _chat_call(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ChatTemplateError as exc:
            raise UnsupportedModelError(str(exc)) from None

    # ------------------------------------------------------------------ forward passes
    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        positions: torch.Tensor,
        *,
        prefix: Sequence[PrefixLayer | None] | None = None,
        segments: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        run: AttentionRun | None = None,
        **run_options,
    ) -> ForwardResult:
        """One pass over ``token_ids [L]`` at ``positions [L]`` after per-layer ``prefix``.

        ``logits_to_keep``: 0 for none, an int ``k`` for the last k, or a LongTensor of rows.
        ``run`` continues an earlier run (decoding); ``run_options`` go to a new ``AttentionRun``.
        """
        device = self.device
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=device).reshape(1, -1)
        positions = positions.to(device=device, dtype=torch.long).reshape(-1)
        segments = (
            torch.zeros_like(positions)
            if segments is None
            else segments.to(device=device, dtype=torch.long)
        )
        if run is None:
            run = AttentionRun(
                positions=positions,
                segments=segments,
                prefix=list(prefix) if prefix else [None] * self.num_layers,
                **run_options,
            )
        else:
            run.advance(positions, segments)
        with runtime.activate(run):
            if isinstance(logits_to_keep, int) and logits_to_keep == 0:
                out = self._base_model()(
                    input_ids=ids, position_ids=positions[None], use_cache=False
                )
                return ForwardResult(None, run, out.last_hidden_state[0])
            out = self.model(
                input_ids=ids,
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logits_to_keep,
            )
        return ForwardResult(out.logits[0].float(), run)

    @torch.inference_mode()
    def token_surprisal(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        *,
        hidden: torch.Tensor | None = None,
        chunk: int = 512,
    ) -> torch.Tensor:
        """``[T]`` float32 negative log-likelihood (nats) of every token given the ones before it
        (0 for the first). ``hidden [T, hidden]``: the prefix's final hidden states
        (``PrefixKV.last_hidden``), else one pass of the decoder computes them. The vocabulary
        projection runs ``chunk`` rows at a time, so a long prefix never holds its ``[T, vocab]``
        logits."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(
            -1
        )
        if hidden is None:
            hidden = self.forward(
                ids, torch.arange(ids.numel(), device=self.device)
            ).hidden
            # a pass that keeps no logits returns the hidden states
            assert hidden is not None
        head = self.model.get_output_embeddings()
        softcap = getattr(self.config, "final_logit_softcapping", None)
        nll = torch.zeros(ids.numel(), dtype=torch.float32, device=self.device)
        for start in range(0, ids.numel() - 1, chunk):
            rows = slice(start, min(start + chunk, ids.numel() - 1))
            logits = head(hidden[rows]).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            targets = ids[rows.start + 1 : rows.stop + 1]
            nll[rows.start + 1 : rows.stop + 1] = -torch.log_softmax(logits, -1).gather(
                1, targets[:, None]
            )[:, 0]
        return nll

    def _base_model(self) -> torch.nn.Module:
        return (
            self.model.get_decoder()
            if hasattr(self.model, "get_decoder")
            else self.model.model
        )

    def prefill(
        self, token_ids: Sequence[int] | torch.Tensor, *, capture_queries: bool = True
    ) -> PrefixKV:
        """Keys/values (and pooled queries) of every layer for a prefix, positions 0..T-1."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(
            -1
        )
        res = self.forward(
            ids,
            torch.arange(ids.numel(), device=self.device),
            capture_kv=True,
            capture_queries=capture_queries,
        )
        run = res.run
        layers = range(self.num_layers)
        return PrefixKV(
            token_ids=ids.cpu(),
            keys=[run.kv[i][0] for i in layers],
            values=[run.kv[i][1] for i in layers],
            queries=[run.queries[i] for i in layers] if capture_queries else None,
            last_hidden=res.hidden,
        )

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(
        self,
        prefix: Sequence[PrefixLayer | None],
        logical_length: int,
        continuation_ids: Sequence[int],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int = 0,
        stop_ids: Sequence[int] | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """Decode after a prefix of logical length T: continuation tokens sit at T, T+1, ...

        Returns ``(new token ids, logits of the first generated token [vocab])``. Greedy when
        ``temperature == 0``.
        """
        if not continuation_ids:
            raise ValueError(
                "generation needs at least one continuation token after the prefix"
            )
        stops = set(stop_ids if stop_ids is not None else self.stop_token_ids())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        n = len(continuation_ids)
        res = self.forward(
            continuation_ids,
            torch.arange(logical_length, logical_length + n, device=self.device),
            prefix=prefix,
            logits_to_keep=1,
            keep_kv=True,
        )
        assert res.logits is not None  # logits_to_keep=1
        first_logits, logits, run = res.logits[-1], res.logits[-1], res.run
        out: list[int] = []
        position = logical_length + n
        for _ in range(max_new_tokens):
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            else:
                token = int(torch.argmax(logits))
            out.append(token)
            if token in stops or len(out) == max_new_tokens:
                break
            res = self.forward(
                [token],
                torch.tensor([position], device=self.device),
                logits_to_keep=1,
                run=run,
            )
            assert res.logits is not None  # logits_to_keep=1
            logits, position = res.logits[-1], position + 1
        return out, first_logits

    def stop_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        for tok in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return sorted(i for i in ids if i is not None)
