"""Sampling invariants (hypothesis) and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gyre.backends.engines.sampling import nucleus, sample_token

logit_lists = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=40)


@settings(max_examples=100, deadline=None)
@given(logit_lists, st.floats(0.05, 1.0), st.floats(0.1, 3.0), st.integers(0, 2**31))
@example([0.0, 1e-9], 0.5, 1.0, 0)  # a tie in float32 that float64 breaks: either token is right
def test_sampled_token_lies_in_the_nucleus_and_logprobs_are_consistent(logits, top_p, temp, seed):
    x = torch.tensor(logits)
    tok, policy_lp, samp_lp = sample_token(x, temperature=temp, top_p=top_p, generator=torch.Generator().manual_seed(seed))
    probs = torch.softmax(x.double() / temp, -1)
    keep = nucleus(probs, top_p)
    # In the float64 nucleus, or tied (to float32 resolution) with its least probable member: the
    # sampler works in float32, where such ties may break the other way.
    assert keep[tok] or float(probs[tok]) >= float(probs[keep].min()) * (1 - 1e-6)
    assert policy_lp == pytest.approx(float(torch.log_softmax(x.double(), -1)[tok]), abs=1e-5)
    assert samp_lp == pytest.approx(math.log(float(probs[tok] / probs[keep].sum())), abs=1e-4)


@settings(max_examples=100, deadline=None)
@given(logit_lists, st.data(), st.integers(0, 2**31))
def test_banned_tokens_are_never_sampled_and_the_policy_logprob_ignores_the_ban(logits, data, seed):
    """min_tokens bans EOS: the draw comes from the rest, renormalised; ℓ_t stays the policy's."""
    x = torch.tensor(logits)
    banned = data.draw(st.lists(st.integers(0, len(logits) - 1), max_size=len(logits) - 1, unique=True))
    tok, policy_lp, samp_lp = sample_token(x, temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(seed),
                                           banned=banned)
    probs = torch.softmax(x.double(), -1)
    allowed = [i for i in range(len(logits)) if i not in banned]
    assert tok in allowed
    assert policy_lp == pytest.approx(math.log(float(probs[tok])), abs=1e-5)
    assert samp_lp == pytest.approx(math.log(float(probs[tok] / probs[allowed].sum())), abs=1e-4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=30).filter(lambda p: sum(p) > 0), st.floats(0.01, 1.0))
def test_nucleus_is_the_smallest_top_set_reaching_top_p(raw, top_p):
    p = torch.tensor(raw, dtype=torch.float64)
    p = p / p.sum()
    keep = nucleus(p, top_p)
    kept = p[keep]
    assert keep.any()
    assert float(kept.sum()) >= min(top_p, 1.0) - 1e-9 or bool(keep[p > 0].all())
    # every kept token is at least as probable as every dropped one
    if (~keep).any():
        assert float(kept.min()) >= float(p[~keep].max())
        # minimal: without its least probable member the set falls short of top_p
        assert float(kept.sum() - kept.min()) < top_p + 1e-12


def test_hand_computed_nucleus_and_greedy():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert nucleus(p, 0.5).tolist() == [True, False, False, False]
    assert nucleus(p, 0.6).tolist() == [True, True, False, False]
    assert nucleus(p, 0.81).tolist() == [True, True, True, False]
    tok, lp, slp = sample_token(torch.log(p), temperature=0.0, top_p=1.0, generator=None)
    assert tok == 0 and lp == pytest.approx(math.log(0.5), abs=1e-6) and slp == 0.0


def test_empirical_frequencies_follow_the_tempered_distribution():
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    g = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sample_token(logits, temperature=0.5, top_p=1.0, generator=g)[0]] += 1
    q = torch.softmax(logits / 0.5, -1)  # ∝ p²: [1, 4, 9, 16] / 30
    assert torch.allclose(q, torch.tensor([1, 4, 9, 16]) / 30.0, atol=1e-6)
    sd = torch.sqrt(n * q * (1 - q))
    assert ((counts - n * q).abs() < 4 * sd).all(), counts


def test_seed_fixes_the_draw_and_bad_arguments_raise():
    x = torch.randn(50, generator=torch.Generator().manual_seed(1))
    draws = lambda s: [sample_token(x, temperature=1.0, top_p=0.9, generator=g)[0] for g in [torch.Generator().manual_seed(s)] for _ in range(20)]
    assert draws(7) == draws(7) and draws(7) != draws(8)
    with pytest.raises(ValueError, match="top_p"):
        sample_token(x, temperature=1.0, top_p=0.0, generator=None)
    with pytest.raises(ValueError, match="temperature"):
        sample_token(x, temperature=-1.0, top_p=1.0, generator=None)
