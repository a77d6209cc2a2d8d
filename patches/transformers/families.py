"""The one table of Transformers model families quantpatch patches, and what each needs.

Every family runs its attention through ``AttentionInterface``; a family entry lists the
config features our attention cannot honour, which make the affected call fall back to the
model's original attention (reported in the handle).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """``causal``: decoder (bottom-right causal) or encoder; ``sliding_window``: some layers use a
    window (honoured through the mask); ``softcap``: config attribute holding an attention logit softcap."""

    causal: bool = True
    sliding_window: bool = False
    softcap: str | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(sliding_window=True),
    "qwen2": Family(sliding_window=True),
    "qwen3": Family(sliding_window=True),
    "gemma": Family(),
    "gemma2": Family(sliding_window=True, softcap="attn_logit_softcapping"),
    "gemma3_text": Family(sliding_window=True, softcap="attn_logit_softcapping"),
    "phi3": Family(sliding_window=True),
    "gpt2": Family(),
    "gpt_neox": Family(),
    "bert": Family(causal=False),
}
