"""The one end-of-output rule (worker.metrics.end_corrected_steps), checked over random step
patterns and random cut points: after the correction the acceptance figures still agree
with each other (AL = 1 + sum(alpha_i), rate = accepted / drafted, beta_i = alpha_i /
alpha_{i-1}), the steps emit exactly the output's decode tokens, and the corrected AL moves
against vLLM's own counters only as far as the rule allows.

What holds between corrected and uncorrected AL. When the output ends inside the last step
(vLLM's case: a request stops at EOS or max_tokens, no step comes after), the correction
only lowers the last step's accepted count, and removes that step's draft when it kept one
token (t = 1; the step then had accepted >= 1). Over a cell, with D drafts, m of them
removed and AL the uncorrected figure:
    AL' - 1 = A' / (D - m) <= (A - m) / (D - m),   so   AL' - AL <= m (AL - 2) / (D - m):
the corrected AL never exceeds the engine's when no draft is removed, and exceeds it only
when removed drafts accepted fewer than the mean. When steps come after the end (not vLLM's
case) they are dropped whole and no bound but AL' <= 1 + k holds.
"""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.metrics import (acceptance_figures, acceptance_length, counts_from_steps,
                            end_corrected_steps, engine_acceptance_length, engine_decode_steps,
                            tokens_per_step)

K_MAX = 5


@st.composite
def step_patterns(draw, min_steps=1):
    """(k, accepted, drafted): decode steps in order; drafted 0 = proposed nothing."""
    k = draw(st.integers(1, K_MAX))
    n = draw(st.integers(min_steps, 12))
    accepted, drafted = [], []
    for _ in range(n):
        if draw(st.booleans()) and draw(st.booleans()):
            accepted.append(0)
            drafted.append(0)
        else:
            d = draw(st.sampled_from([k, k, draw(st.integers(1, k))]))
            drafted.append(d)
            accepted.append(draw(st.integers(0, d)))
    return k, accepted, drafted


def emitted(accepted):
    return sum(a + 1 for a in accepted)


def check_consistent(c, k):
    fig = acceptance_figures(c)
    if not c.drafts:
        assert fig["acceptance_length"] is None and fig["per_position_acceptance"] == []
        return fig
    alpha = fig["per_position_acceptance"]
    assert fig["acceptance_length"] == pytest.approx(1 + sum(alpha))
    assert fig["acceptance_rate"] == pytest.approx(c.accepted_tokens / c.draft_tokens)
    assert 0 <= fig["acceptance_rate"] <= 1
    assert all(x >= y for x, y in zip(alpha, alpha[1:])), alpha
    assert all(0 <= x <= 1 for x in alpha)
    beta = fig["conditional_acceptance"]
    previous = 1.0
    for a, b in zip(alpha, beta):
        if previous:
            assert b == pytest.approx(a / previous)
            assert 0 <= b <= 1
        else:
            assert b is None
        previous = a
    assert 1 <= fig["acceptance_length"] <= 1 + k
    return fig


@settings(max_examples=400, deadline=None)
@given(step_patterns(), st.data())
def test_a_cut_anywhere_keeps_the_figures_consistent_and_the_tokens_exact(pattern, data):
    k, accepted, drafted = pattern
    total = emitted(accepted)
    out = data.draw(st.integers(0, total), label="decode tokens kept")
    a2, d2 = end_corrected_steps(accepted, drafted, out)
    assert emitted(a2) == out
    assert len(a2) == len(d2) <= len(accepted)
    # Steps before the end are untouched; the end step counts the tokens it emitted.
    kept = max(len(a2) - 1, 0)
    assert a2[:kept] == accepted[:kept] and d2[:kept] == drafted[:kept]
    if a2:
        j = len(a2) - 1
        t = out - emitted(a2[:-1])
        if t < accepted[j] + 1:
            assert (a2[j], d2[j]) == (t - 1, min(drafted[j], t - 1))
        else:
            assert (a2[j], d2[j]) == (accepted[j], drafted[j])
    assert all(0 <= a <= d or (a, d) == (0, 0) for a, d in zip(a2, d2))
    fig = check_consistent(counts_from_steps(a2, d2, k), k)
    # Tokens per step counts every decode step, so it is never above AL (equal when every
    # step drafted), and 1 + accepted / steps exactly.
    tps = tokens_per_step(out, len(a2))
    if a2:
        assert tps == pytest.approx(1 + sum(a2) / len(a2))
        if fig["acceptance_length"] is not None:
            assert tps <= fig["acceptance_length"] + 1e-12
            if all(d > 0 for d in d2):
                assert tps == pytest.approx(fig["acceptance_length"])
    else:
        assert tps is None and out == 0
    # Nothing cut: nothing changes.
    if out == total:
        assert (a2, d2) == (accepted, drafted)


@settings(max_examples=300, deadline=None)
@given(st.lists(step_patterns(), min_size=1, max_size=6), st.data())
def test_ending_inside_the_last_step_moves_al_only_as_far_as_the_rule_allows(requests, data):
    """A cell of requests cut the way vLLM cuts them (inside their last step)."""
    k = max(p[0] for p in requests)
    raw = corrected = None
    for _, accepted, drafted in requests:
        total = emitted(accepted)
        out = data.draw(st.integers(total - accepted[-1], total), label="decode tokens kept")
        a2, d2 = end_corrected_steps(accepted, drafted, out)
        assert len(a2) == len(accepted)
        r, c = counts_from_steps(accepted, drafted, k), counts_from_steps(a2, d2, k)
        raw = r if raw is None else raw + r
        corrected = c if corrected is None else corrected + c
    check_consistent(corrected, k)
    check_consistent(raw, k)
    assert corrected.accepted_tokens <= raw.accepted_tokens
    assert corrected.draft_tokens <= raw.draft_tokens
    m = raw.drafts - corrected.drafts
    # every removed draft took at least one accepted token with it
    assert raw.accepted_tokens - corrected.accepted_tokens >= m
    al, al2 = engine_acceptance_length(raw), acceptance_length(corrected)
    if al2 is None:
        assert corrected.drafts == 0
        return
    if m == 0:
        assert al2 <= al + 1e-12
    else:
        assert al2 <= al + m * (al - 2) / (raw.drafts - m) + 1e-12


def test_the_issue_example_counts_a_cut_step_as_the_tokens_it_emitted():
    # A step that drafted 3, all accepted, cut to 2 tokens: a draft of 1 token, accepted,
    # plus its bonus token -- rate 1, AL 2, and alpha_2 = alpha_3 = 0 consistently.
    a2, d2 = end_corrected_steps([3], [3], 2)
    assert (a2, d2) == ([1], [1])
    fig = acceptance_figures(counts_from_steps(a2, d2, 3))
    assert fig["acceptance_rate"] == 1.0 and fig["acceptance_length"] == 2.0
    assert fig["per_position_acceptance"] == [1.0, 0.0, 0.0]
    # Cut to one token: no draft left, a step that emitted one token.
    assert end_corrected_steps([3], [3], 1) == ([0], [0])
    # The output ended at the prefill's token: no decode step counts.
    assert end_corrected_steps([2, 1], [3, 3], 0) == ([], [])
    # Steps after the end are dropped.
    assert end_corrected_steps([1, 0, 2], [3, 0, 3], 3) == ([1, 0], [3, 0])


def test_records_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match="emit 4 decode tokens"):
        end_corrected_steps([1, 1], [3, 3], 5)
    with pytest.raises(ValueError, match="accepted 4 of 3"):
        end_corrected_steps([4], [3], 2)
    with pytest.raises(ValueError):
        end_corrected_steps([1], [3, 3], 1)


@settings(max_examples=300, deadline=None)
@given(step_patterns(), st.data())
def test_vllm_records_line_up_into_decode_steps(pattern, data):
    """vLLM lists only the steps that drafted; step_tokens has them all (cut at the end).
    Lining them up and correcting gives the counts of the true step sequence."""
    k, accepted, drafted = pattern
    total = emitted(accepted)
    out = data.draw(st.integers(total - accepted[-1], total), label="decode tokens kept")
    cut = total - out
    step_tokens = [1] + [a + 1 for a in accepted]
    step_tokens[-1] -= cut
    spec = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
    lined = engine_decode_steps([a for a, _ in spec], [d for _, d in spec], step_tokens)
    assert lined is not None
    la, ld = lined
    assert len(la) == len(accepted)
    assert counts_from_steps(la, ld, k) == counts_from_steps(accepted, drafted, k)
    a2, d2 = end_corrected_steps(la, ld, sum(step_tokens[1:]))
    expected = end_corrected_steps(accepted, drafted, out)
    assert counts_from_steps(a2, d2, k) == counts_from_steps(*expected, k)
    assert len(a2) == len(expected[0])


def test_vllm_records_that_do_not_line_up_give_none():
    assert engine_decode_steps([1, 3], [3, 3], [1, 2, 1, 4]) == ([1, 0, 3], [3, 0, 3])
    assert engine_decode_steps([1, 3], [3, 3], [1, 2, 1, 2]) == ([1, 0, 3], [3, 0, 3])
    assert engine_decode_steps([1, 3], [3, 3], [1, 3, 1]) is None      # 3 != 1 + 1
    assert engine_decode_steps([1, 3], [3, 3], [1, 2]) is None         # a step missing
    assert engine_decode_steps([1], [3, 3], [1, 2]) is None
    # Without per-step tokens the verification steps alone come back.
    assert engine_decode_steps([2], [3], []) == ([2], [3])


def test_tokens_per_step_against_al_on_an_ngram_like_request():
    # Drafts in 2 of 5 decode steps, accepting 3 and 2: AL 3.5, tokens per step 2.0.
    accepted, drafted = [3, 0, 0, 2, 0], [4, 0, 0, 4, 0]
    out = emitted(accepted)
    a2, d2 = end_corrected_steps(accepted, drafted, out)
    assert acceptance_length(counts_from_steps(a2, d2, 4)) == 3.5
    assert tokens_per_step(out, len(a2)) == 2.0
    assert tokens_per_step(10, 10) == 1.0 and tokens_per_step(0, 0) is None
    assert not math.isnan(tokens_per_step(3, 2))
