"""Prefix-keeping boolean key masks (HunyuanVideo's padded text): the kernels' unmasked call over the kept keys.

:func:`kept_prefix` on every mask form, its once-per-mask read; and the Diffusers router on the tiny HunyuanVideo:
where a kernel takes the call (forced here: the CPU routes everything to SDPA), the attention gets the kept keys and
no mask, and the model's output matches the masked one; where SDPA runs, the masked call is the processor's own.
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
    ([[1, 1, 1, 0, 0]], 3),
    ([[1, 1, 0, 0], [1, 1, 0, 0]], 2),
    ([[1, 1, 1, 1]], 4),
    ([[1, 0, 1, 0]], None),  # a hole
    ([[1, 1, 0, 0], [1, 1, 1, 0]], None),  # rows keep different counts
    ([[0, 0, 0]], None),  # no key
    ([[0, 1, 1]], None),  # a suffix, not a prefix
])
def test_kept_prefix_reads_the_prefix_or_declines(rows, expected):
    mask = _mask(rows).bool()
    assert key_padding.kept_prefix(mask, mask.shape[-1]) == expected


def test_other_masks_decline_and_a_mask_is_read_once_per_version(monkeypatch):
    keep3 = _mask([[1, 1, 1, 0]]).bool()
    assert key_padding.kept_prefix(keep3.float(), 4) is None  # additive masks are not read
    assert key_padding.kept_prefix(keep3.expand(1, 1, 2, 4), 4) is None  # a per-query mask
    assert key_padding.kept_prefix(keep3, 5) is None  # not this call's keys
    reads = []
    monkeypatch.setattr(torch, "stack", lambda *a, **k: reads.append(1) or torch.cat([t[None] for t in a[0]]))
    assert key_padding.kept_prefix(keep3, 4) == 3 and key_padding.kept_prefix(keep3, 4) == 3
    assert len(reads) == 1
    keep3[0, 0, 0, 3] = True  # changed in place: read again
    assert key_padding.kept_prefix(keep3, 4) == 4 and len(reads) == 2


def test_masks_are_not_read_where_a_sync_is_not_allowed(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert key_padding.kept_prefix(_mask([[1, 1, 0]]).bool(), 3) is None  # the masked call, as traced


def test_router_gives_the_kernels_the_kept_keys_and_no_mask(monkeypatch, no_leaks):
    model, call = tiny_transformer("HunyuanVideoTransformer3DModel")
    base = call()
    seen = []

    def sdpa_over_kept_keys(query, key, value, *, attn_mask, is_causal, scale, layout, **kwargs):
        if layout == "BHSD":  # the token refiner's own SDPA call (its mask is per query: not a prefix mask)
            return SDPA(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        seen.append((key.shape[1], attn_mask))
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return SDPA(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale).transpose(1, 2)

    # the CPU routes every call to SDPA: pretend a kernel takes the long enough ones, and run SDPA in its place
    monkeypatch.setattr(processors, "speed_reason", lambda *args: None)
    monkeypatch.setattr(processors, "speed_route", lambda call, lengths=None: (object(), [], None))
    monkeypatch.setattr(processors, "attention", sdpa_over_kept_keys)
    with qp.patch_model(model, "sage2-8b"):
        out = call()
    masked_calls = [(nk, mask) for nk, mask in seen]
    assert masked_calls and all(mask is None for _, mask in masked_calls)
    assert {nk for nk, _ in masked_calls} == {3 * 4 * 4 + 5}  # 48 video tokens + 5 valid of 7 text tokens
    torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-5)  # the masked attention, over the kept keys


def test_calls_left_to_sdpa_keep_their_mask_and_bits(no_leaks):
    model, call = tiny_transformer("HunyuanVideoTransformer3DModel")
    base = call()
    with qp.patch_model(model, "sage2-8b"):  # CPU, policy="speed": every call the processor's own
        assert torch.equal(call(), base)
