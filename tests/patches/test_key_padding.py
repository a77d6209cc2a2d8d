"""Prefix-keeping boolean key masks (HunyuanVideo's padded text): the kernels' unmasked call over the kept keys.

:func:`kept_prefixes` on every mask form, its once-per-mask read; and the Diffusers router on the tiny HunyuanVideo:
where a kernel takes the calls (forced here: the CPU routes everything to SDPA), the attention gets the kept keys
and no mask, once for the batch or once a row, and the model's output matches the masked one; where SDPA runs, the
masked call is the processor's own.
"""

import pytest
import torch

import quantpatch as qp
from quantpatch.patches.diffusers import key_padding, processors
from quantpatch.testing.diffusers_tiny import tiny_transformer

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

pytest.importorskip("diffusers")

SDPA = torch.nn.functional.scaled_dot_product_attention  # the router swaps the name while a processor runs


def _mask(rows: list[list[bool]]) -> torch.Tensor:
    return torch.tensor(rows)[:, None, None, :]


@pytest.mark.parametrize("rows, expected", [
    ([[1, 1, 1, 0, 0]], (3,)),
    ([[1, 1, 0, 0], [1, 1, 0, 0]], (2, 2)),
    ([[1, 1, 1, 1]], (4,)),
    ([[1, 1, 0, 0], [1, 1, 1, 0]], (2, 3)),  # rows keep different counts: one call each
    ([[1, 0, 1, 0]], None),  # a hole
    ([[1, 1, 0, 0], [1, 0, 1, 0]], None),  # a hole in one row
    ([[0, 0, 0]], None),  # no key
    ([[1, 1, 0], [0, 0, 0]], None),  # no key in one row
    ([[0, 1, 1]], None),  # a suffix, not a prefix
])
def test_kept_prefixes_read_each_rows_prefix_or_decline(rows, expected):
    mask = _mask(rows).bool()
    assert key_padding.kept_prefixes(mask, mask.shape[-1]) == expected


def test_other_masks_decline_and_a_mask_is_read_once_per_version(monkeypatch):
    keep3 = _mask([[1, 1, 1, 0]]).bool()
    assert key_padding.kept_prefixes(keep3.float(), 4) is None  # additive masks are not read
    assert key_padding.kept_prefixes(keep3.expand(1, 1, 2, 4), 4) is None  # a per-query mask
    assert key_padding.kept_prefixes(keep3, 5) is None  # not this call's keys
    reads = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: reads.append(1) or cat(*a, **k))
    assert key_padding.kept_prefixes(keep3, 4) == (3,) and key_padding.kept_prefixes(keep3, 4) == (3,)
    assert len(reads) == 1
    keep3[0, 0, 0, 3] = True  # changed in place: read again
    assert key_padding.kept_prefixes(keep3, 4) == (4,) and len(reads) == 2
    assert key_padding.kept_prefixes(_mask([[1, 0], [1, 1]]).bool().expand(2, 1, 1, 2), 2) == (1, 2)  # strided


def test_masks_are_not_read_where_a_sync_is_not_allowed(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert key_padding.kept_prefixes(_mask([[1, 1, 0]]).bool(), 3) is None  # the masked call, as traced


def _hunyuan_batch(valid: tuple[int, ...]):
    """The tiny HunyuanVideo and a call on a batch whose rows keep ``valid`` of 7 text tokens each."""
    model, _ = tiny_transformer("HunyuanVideoTransformer3DModel")
    batch = len(valid)
    gen = torch.Generator().manual_seed(5)
    mask = torch.zeros(batch, 7, dtype=torch.long)
    for b, n in enumerate(valid):
        mask[b, :n] = 1
    inputs = dict(hidden_states=torch.randn(batch, 4, 3, 8, 8, generator=gen), timestep=torch.tensor([500] * batch),
                  encoder_hidden_states=torch.randn(batch, 7, 16, generator=gen), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(batch, 8, generator=gen), guidance=torch.tensor([3500.0] * batch))

    def call():
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    return model, call


@pytest.mark.parametrize("valid, calls", [((5,), [(1, 53)]), ((5, 5), [(2, 53)]), ((5, 3), [(1, 53), (1, 51)])])
def test_router_gives_the_kernels_the_kept_keys_and_no_mask(valid, calls, monkeypatch, no_leaks):
    """One call over the batch where its rows keep the same text tokens, one a row where they differ: each over its
    row's kept keys (48 video tokens and the valid text), with no mask, and the masked attention's output."""
    model, call = _hunyuan_batch(valid)
    base = call()
    seen = []

    def sdpa_over_kept_keys(query, key, value, *, scale, layout, attn_mask=None, is_causal=False, **kwargs):
        if layout == "BHSD":  # the token refiner's own SDPA call (its mask is per query: not a prefix mask)
            return SDPA(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        seen.append((key.shape[0], key.shape[1], attn_mask))
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return SDPA(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale).transpose(1, 2)

    # the CPU routes every call to SDPA: pretend a kernel takes the long enough ones, and run SDPA in its place
    monkeypatch.setattr(processors, "speed_reason", lambda *args: None)
    monkeypatch.setattr(processors, "speed_route", lambda call, lengths=None: (object(), [], None))
    monkeypatch.setattr(processors, "attention", sdpa_over_kept_keys)
    with qp.patch_model(model, "sage2-8b"):
        out = call()
    assert seen and all(mask is None for *_, mask in seen)
    blocks = 2  # one double-stream and one single-stream block
    assert [(b, nk) for b, nk, _ in seen] == calls * blocks
    torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-5)  # the masked attention, over the kept keys


def test_rows_go_to_their_own_masked_call_unless_a_kernel_takes_every_row(monkeypatch, no_leaks):
    model, call = _hunyuan_batch((5, 3))
    base = call()
    monkeypatch.setattr(processors, "speed_reason", lambda *args: None)
    # a kernel takes only the longer row's call: the batch keeps its masked call, SDPA's, bit for bit
    monkeypatch.setattr(processors, "speed_route", lambda call, lengths=None: (
        (object(), [], None) if call.k.shape[2] == 53 and call.attn_mask is None else (None, [], "too short")))
    with qp.patch_model(model, "sage2-8b"):
        assert torch.equal(call(), base)


def test_calls_left_to_sdpa_keep_their_mask_and_bits(no_leaks):
    model, call = tiny_transformer("HunyuanVideoTransformer3DModel")
    base = call()
    with qp.patch_model(model, "sage2-8b"):  # CPU, policy="speed": every call the processor's own
        assert torch.equal(call(), base)
