"""Every family's adapter against the model's own forward: prefill, pruned prefill, decode, rollback."""

from __future__ import annotations

import torch

from tests.conftest import random_frames, tiny_pair


def _masked_reference(adapter, emb, sel: torch.Tensor) -> torch.Tensor:
    """Last-token logits of the FULL sequence with every token outside `sel` masked out of attention."""
    mask = torch.zeros(emb.seq_len, dtype=torch.long)
    mask[sel] = 1
    out = adapter.language_model(
        inputs_embeds=emb.embeds,
        position_ids=emb.positions if adapter.position_rows > 1 else emb.positions[0],
        attention_mask=mask.unsqueeze(0),
        **adapter._language_kwargs(emb, torch.arange(emb.layout.num_tokens)),
    )
    return adapter.model.lm_head(out.last_hidden_state[:, -1]).float()[0]


def test_full_prefill_matches_model_forward(family):
    target, _ = tiny_pair(family)
    inputs = target.prepare(random_frames(0), "Describe the video.")
    with torch.inference_mode():
        ref = target.model(input_ids=inputs.input_ids, **inputs.pixel_inputs).logits[0, -1].float()
    got = target.prefill(target.embed(inputs)).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_keep_all_equals_full_and_subset_equals_masked(family):
    target, _ = tiny_pair(family)
    inputs = target.prepare(random_frames(1), "What happens in this video?")
    emb = target.embed(inputs)
    full = target.prefill(emb).logits
    everything = torch.arange(inputs.layout.num_tokens)
    torch.testing.assert_close(target.prefill(emb, keep=everything).logits, full, atol=1e-6, rtol=0)

    keep = torch.arange(0, inputs.layout.num_tokens, 3)
    pruned = target.prefill(emb, keep=keep).logits
    sel = target.kept_sequence_positions(inputs.layout, emb.seq_len, keep)
    with torch.inference_mode():
        ref = _masked_reference(target, emb, sel)
    torch.testing.assert_close(pruned, ref, atol=1e-5, rtol=1e-5)
    assert (pruned - full).abs().max() > 1e-4  # pruning changed something: the test can fail


def test_manual_greedy_matches_generate(family):
    target, _ = tiny_pair(family)
    inputs = target.prepare(random_frames(2), "Describe the video.")
    with torch.inference_mode():
        gen = target.model.generate(
            input_ids=inputs.input_ids,
            attention_mask=torch.ones_like(inputs.input_ids),
            **inputs.pixel_inputs,
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
        )[0, inputs.seq_len :].tolist()
    res = target.prefill(target.embed(inputs))
    tokens = [int(res.logits.argmax())]
    while len(tokens) < 8:
        tokens.append(int(target.step(res.state, torch.tensor([tokens[-1]]))[-1].argmax()))
    assert tokens == gen


def test_rollback_then_decode_equals_fresh_prefix(family):
    target, _ = tiny_pair(family)
    inputs = target.prepare(random_frames(3), "Describe the video.")
    emb = target.embed(inputs)
    keep = torch.arange(0, inputs.layout.num_tokens, 2)
    a = target.prefill(emb, keep=keep)
    b = target.prefill(emb, keep=keep)
    prefix, junk = [5, 9, 11], [17, 23, 29, 31]
    target.step(a.state, torch.tensor(prefix + junk))
    target.rollback(a.state, a.state.prefill_len + len(prefix))
    after_rollback = target.step(a.state, torch.tensor([42, 43]))
    fresh = target.step(b.state, torch.tensor(prefix + [42, 43]))[-2:]
    torch.testing.assert_close(after_rollback, fresh, atol=1e-5, rtol=1e-5)
