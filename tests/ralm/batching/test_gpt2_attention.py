"""GPT-2's attention on a packed batch (ralm/batching/gpt2_attention.py): the same bits as
transformers' attention forward, in fewer host ops; dropout modules become the identity."""

from __future__ import annotations

import pytest
import torch

from ralm.batching.invariant import NoDropout, make_invariant
from ralm.batching.op_count import decode_iteration_ops
from tests.factories import restore_hf_attention, tiny_causal_lm, two_sequence_forwards

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("paged", [True, False], ids=["pool", "standalone"])
def test_the_packed_forward_gives_transformers_attention_bits(paged):
    model = make_invariant(tiny_causal_lm("gpt2", vocab_size=300, eos_token_id=0, seed=3))
    assert sum(hasattr(m, "_ralm_hf_forward") for m in model.modules()) == model.config.n_layer
    fast = two_sequence_forwards(model, paged, with_hidden=True)
    restore_hf_attention(model)
    slow = two_sequence_forwards(model, paged, with_hidden=True)
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)


def test_dropout_is_the_identity_and_the_host_cost_falls():
    plain = tiny_causal_lm("gpt2", vocab_size=300, eos_token_id=0, seed=3).eval()
    n_dropout = sum(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    model = make_invariant(tiny_causal_lm("gpt2", vocab_size=300, eos_token_id=0, seed=3).eval())
    assert n_dropout > 0 and not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    assert sum(isinstance(m, NoDropout) for m in model.modules()) == n_dropout
    fast = decode_iteration_ops(model, 16, context=80)
    restore_hf_attention(model)
    slow = decode_iteration_ops(model, 16, context=80)
    # view + split + 2 transposes + 1 reshape instead of split, 3 views and 3 transposes, the
    # interface's selects and transpose, and the output's reshape, unsqueeze and reshape
    assert fast["ops_per_layer"] <= slow["ops_per_layer"] - 6, (fast, slow)
    assert fast["python_tensors"] == slow["python_tensors"] and fast["host_reads"] == 0


def test_a_packed_forward_with_padding_rows_does_not_warn_about_an_attention_mask():
    """The padding rows are token 0, GPT-2's pad token here, last in the forward: transformers
    would warn to pass an attention mask, which a packed forward's attention does not need."""
    import logging

    from transformers.utils import logging as hf_logging

    import ralm.batching.packed as packed
    from ralm.batching.paged_kv import PagedKV

    model = make_invariant(tiny_causal_lm("gpt2", vocab_size=300, eos_token_id=0, seed=3))
    assert model.config.pad_token_id == 0 and packed.row_multiple(model) > 1  # padded with the pad token
    seen: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("transformers.modeling_utils")
    handler = Seen()
    logger.addHandler(handler)

    def forward_once() -> None:
        hf_logging.warning_once.cache_clear()  # the warning is once per process
        with torch.inference_mode():
            packed.packed_forward(model, [(PagedKV.standalone(model.config.n_layer), [5, 6, 7])])

    try:
        forward_once()
        assert not [m for m in seen if "attention_mask" in m]
        filters = [f for f in logger.filters if isinstance(f, packed._PaddedRowsNeedNoMask)]
        for f in filters:  # without the filter the same forward warns: the test can see it
            logger.removeFilter(f)
        try:
            forward_once()
        finally:
            for f in filters:
                logger.addFilter(f)
        assert [m for m in seen if "attention_mask" in m]
    finally:
        logger.removeHandler(handler)
