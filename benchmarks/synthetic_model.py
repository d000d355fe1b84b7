"""Random-weight Llama models with a word-level chat tokenizer, built in memory on any device.

The GPU machines have no model weights of ours (no hub, a few MiB of files), so the device checks
build their models here: real transformers Llama modules with real shapes (e.g. Llama-3-8B's
layers) and random weights, and a tokenizer whose words are ``w0 .. wN`` with a ChatML template.
Timings and exactness hold for such a model; quality claims never rest on one.
"""

from __future__ import annotations

import random

import torch

__all__ = ["LLAMA3_8B", "TINY", "synthetic_llama", "synthetic_messages"]

#: Llama-3-8B's layer shapes (32 query heads, 8 KV heads, d = 128, llama3 RoPE at 500k).
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
#: A small GQA model for exactness checks.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)
SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(vocab_words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + [f"w{i}" for i in range(vocab_words)]
    tok = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )


def synthetic_llama(
    shape: dict,
    *,
    layers: int,
    device: str | torch.device = "cpu",
    vocab_words: int = 1000,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A ``LlamaAdapter`` over a random-weight ``LlamaForCausalLM`` of ``shape`` with ``layers``
    decoder layers on ``device``, with the word-level chat tokenizer. The weights are drawn on
    the CPU (a seed gives the same model on every device) and moved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_compaction.models.llama import LlamaAdapter

    tokenizer = _tokenizer(vocab_words)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_hidden_layers=layers,
        architectures=["LlamaForCausalLM"],
        **shape,
    )
    torch.manual_seed(seed)
    with torch.device("meta" if str(device) == "meta" else "cpu"):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return LlamaAdapter(model.to(device), tokenizer, name=f"synthetic-llama-{layers}l")


def synthetic_messages(
    tokens: int, *, vocab_words: int = 1000, turns: int = 4, seed: int = 0
) -> list[dict]:
    """A conversation of ``turns`` alternating turns holding about ``tokens`` words in all."""
    rng = random.Random(seed)
    per_turn = max(1, tokens // turns)
    roles = ("user", "assistant")
    return [
        {
            "role": roles[i % 2],
            "content": " ".join(
                f"w{rng.randrange(vocab_words)}" for _ in range(per_turn)
            ),
        }
        for i in range(turns)
    ]
