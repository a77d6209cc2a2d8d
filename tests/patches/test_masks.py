"""The shape-only mask skip registered over sdpa (patches/transformers/masks.py)."""

import pytest
import torch

from quantpatch.patches.transformers.masks import shape_skipping_mask

masking_utils = pytest.importorskip("transformers.masking_utils")
sdpa_mask = masking_utils.sdpa_mask
causal = masking_utils.causal_mask_function


def _args(q_length=8, kv_length=8, **kw):
    return dict(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=kv_length - q_length, kv_offset=0,
                mask_function=causal, allow_is_causal_skip=True, device="cpu", **kw)


@pytest.mark.parametrize("q_length, kv_length", [(8, 8), (1, 9)])
def test_plain_causal_mask_is_skipped(q_length, kv_length):
    assert shape_skipping_mask(sdpa_mask)(**_args(q_length, kv_length)) is None


@pytest.mark.parametrize("q_length, kv_length", [(3, 8), (1, 9)])  # a chunk (built by the original), a decode step
def test_positional_arguments_are_read_by_their_names(q_length, kv_length):
    args = _args(q_length, kv_length)
    positional = [args.pop(name) for name in ("batch_size", "q_length", "kv_length")]
    wrapped = shape_skipping_mask(sdpa_mask)(*positional, **args)
    if q_length == 1:
        assert wrapped is None
    else:
        assert torch.equal(wrapped, sdpa_mask(*positional, **{**args, "allow_is_causal_skip": False}))


@pytest.mark.parametrize(
    "kw",
    [
        dict(q_length=3, kv_length=8),  # chunked prefill over a cache: the mask is not plain causal
        dict(attention_mask=torch.tensor([[1] * 8, [0] * 2 + [1] * 6], dtype=torch.bool)),  # left padding
        dict(mask_function=masking_utils.sliding_window_causal_mask_function(4), local_size=4),  # window reaches back
        dict(allow_is_causal_skip=False),  # the caller forbids the skip (packed sequences, or/and masks)
    ],
    ids=["chunk", "padding", "sliding", "not-allowed"],
)
def test_other_masks_are_built_by_the_original(kw):
    args = {**_args(kw.pop("q_length", 8), kw.pop("kv_length", 8)), **kw}
    wrapped = shape_skipping_mask(sdpa_mask)(**args)
    assert wrapped is not None
    assert torch.equal(wrapped, sdpa_mask(**{**args, "allow_is_causal_skip": False}))


def test_bidirectional_skip_follows_the_caller():
    args = dict(_args(), mask_function=masking_utils.bidirectional_mask_function, allow_is_causal_skip=False)
    assert shape_skipping_mask(sdpa_mask)(**args, allow_is_bidirectional_skip=True) is None
    assert shape_skipping_mask(sdpa_mask)(**args, allow_is_bidirectional_skip=False).all()


def test_skip_decision_holds_while_torch_compile_traces():
    mask_fn = shape_skipping_mask(sdpa_mask)

    def marked(x):  # x + 1 where a mask was materialised, x where it was skipped
        mask = mask_fn(**_args())
        return x if mask is None else x + mask.any().to(x.dtype)

    x = torch.zeros(3)
    assert torch.equal(torch.compile(marked, backend="eager", fullgraph=True)(x), x)
