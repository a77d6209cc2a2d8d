"""Fixtures for patcher tests: tiny models of every family, and a leak detector."""

import pytest
import torch

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)


def tiny_model(family: str):
    """A randomly initialised 2-layer model of ``family`` (head_dim 32), built from config."""
    import transformers as T

    torch.manual_seed(0)
    gqa = dict(num_key_value_heads=1)
    configs = {
        "llama": lambda: T.LlamaConfig(**TINY, **gqa),
        "mistral": lambda: T.MistralConfig(**TINY, **gqa, sliding_window=8),
        "qwen2": lambda: T.Qwen2Config(**TINY, **gqa),
        "qwen3": lambda: T.Qwen3Config(**TINY, **gqa, head_dim=32),
        "gemma": lambda: T.GemmaConfig(**TINY, **gqa, head_dim=32),
        "gemma2": lambda: T.Gemma2Config(**TINY, **gqa, head_dim=32, sliding_window=8),
        "gemma3_text": lambda: T.Gemma3TextConfig(**TINY, **gqa, head_dim=32, sliding_window=8),
        "phi3": lambda: T.Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gpt2": lambda: T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0),
        "gpt_neox": lambda: T.GPTNeoXConfig(**TINY),
        "bert": lambda: T.BertConfig(**TINY),
    }
    config = configs[family]()
    auto = T.AutoModel if family == "bert" else T.AutoModelForCausalLM
    return auto.from_config(config).eval()


def _global_state():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return dict(AttentionInterface._global_mapping), dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)


@pytest.fixture
def no_leaks():
    """Fails a test that leaves quantpatch entries in Transformers' global registries."""
    before = _global_state()
    yield
    assert _global_state() == before, "patching leaked a global registration"
