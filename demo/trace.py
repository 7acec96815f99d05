"""What the live demo shows, computed from the reference engine's step traces.

Pure functions and small classes, with no Gradio (and no torch) import, so that the main
environment (vllm, no gradio) can test them. ``demo/app.py`` turns their output into Gradio
components.

- ``TraceView`` follows one sequence step by step: each emitted token becomes a highlighted
  span (``(text, label)``, the value of ``gr.HighlightedText``) labelled by where it came
  from, each step becomes a row of the step log (with the rejected draft tokens), and the
  counters come from ``worker.metrics`` on a ``SpecCounts`` built from the traces.
- Labels: ``accepted`` (a drafted token the target accepted), ``corrected`` (the target's
  own token after it rejected a draft), ``bonus`` (the target's extra token after it
  accepted the whole draft), ``target`` (a step with no draft: the prefill, or a step where
  the drafter proposed nothing; plain decoding).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from worker import metrics

ACCEPTED, CORRECTED, BONUS, TARGET = "accepted", "corrected", "bonus", "target"
LABELS = (ACCEPTED, CORRECTED, BONUS, TARGET)
# Colours of the labels in the demo (accepted drafts green, the target's own tokens otherwise).
COLORS = {ACCEPTED: "#86efac", CORRECTED: "#fca5a5", BONUS: "#93c5fd", TARGET: "#e5e7eb"}
STEP_LOG_HEADERS = ["step", "drafted", "accepted", "rejected", "target token", "kind"]


def step_labels(trace) -> list[str]:
    """One label per token the step emitted (``trace.emitted``): the accepted prefix of the
    draft, then the target's own token (corrected, bonus, or plain when nothing was drafted)."""
    labels = []
    for i, _ in enumerate(trace.emitted):
        if i < trace.accepted:
            labels.append(ACCEPTED)
        elif not trace.drafted:
            labels.append(TARGET)
        elif trace.accepted < len(trace.drafted):
            labels.append(CORRECTED)
        else:
            labels.append(BONUS)
    return labels


def kept_draft(trace, eos_ids=()) -> tuple[int, int]:
    """(accepted, drafted) tokens of one step as ``worker.metrics`` counts them: drafted
    tokens after an end-of-sequence token that the target accepted are not counted."""
    drafted = list(trace.drafted)
    accepted = int(trace.accepted)
    eos = set(eos_ids)
    cut = next((i + 1 for i, t in enumerate(drafted[:accepted]) if t in eos), None)
    if cut is not None:  # the sequence ended inside the accepted draft
        drafted, accepted = drafted[:cut], min(accepted, cut)
    return accepted, len(drafted)


def counts_from_traces(traces, eos_ids=()) -> metrics.SpecCounts:
    """Speculation counts of steps, as ``worker.metrics`` defines them: a draft is a step
    that proposed at least one token; the bonus token is not an accepted token."""
    kept = [kept_draft(trace, eos_ids) for trace in traces]
    return metrics.counts_from_steps([a for a, _ in kept], [d for _, d in kept])


class TokenTexts:
    """Incremental detokenisation: the text each new token adds to the output.

    Decoding token by token breaks characters that span several tokens (byte-level BPE), so
    each token's text is the growth of the decoded output; a token that ends inside a
    character adds nothing until the token that completes it. ``"".join`` of the pieces is
    the decoded output. ``decode`` maps a list of ids to text (the tokenizer's)."""

    def __init__(self, decode, special_texts=None):
        self.decode = decode
        self.special_texts = special_texts or {}
        self.ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        full = self.decode(self.ids)
        if full.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        if full.startswith(self.text):
            piece = full[len(self.text):]
        else:  # the decoder rewrote earlier text (clean-up of spaces): show this token alone
            piece = self.decode([token_id])
        self.text = full
        if not piece and token_id in self.special_texts:
            piece = self.special_texts[token_id]
        return piece


@dataclass
class StepRow:
    step: int
    drafted: list[str]
    accepted: int
    rejected: list[str]
    target_token: str
    kind: str

    def as_list(self):
        return [self.step, " ".join(map(repr, self.drafted)), self.accepted,
                " ".join(map(repr, self.rejected)),
                repr(self.target_token) if self.kind in (TARGET, BONUS, CORRECTED) else "",
                self.kind]


@dataclass
class TraceView:
    """The demo's view of one generating sequence; feed it the StepTraces in order.

    ``decode`` maps token ids to text; ``token_text`` one id to its vocabulary string (for
    the step log's drafted and rejected tokens, which are not part of the output)."""

    decode: object
    token_text: object
    eos_ids: frozenset = frozenset()
    spans: list = field(default_factory=list)  # (text, label) per emitted token
    rows: list = field(default_factory=list)  # StepRow per step
    traces: list = field(default_factory=list)

    def __post_init__(self):
        specials = {t: self.token_text(t) for t in self.eos_ids}
        self.texts = TokenTexts(self.decode, specials)

    def add(self, trace):
        self.traces.append(trace)
        labels = step_labels(trace)
        for token, label in zip(trace.emitted, labels):
            self.spans.append((self.texts.add(token), label))
        drafted = list(trace.drafted)
        own = trace.bonus
        # The sequence ended (EOS) inside the accepted draft: what followed was never checked.
        ended = own is None and trace.accepted > 0 and drafted[trace.accepted - 1] in self.eos_ids
        rejected = [] if ended else drafted[trace.accepted:]
        kind = ("end of sequence" if ended else "" if own is None else
                TARGET if not drafted else BONUS if trace.accepted == len(drafted) else CORRECTED)
        self.rows.append(StepRow(
            step=trace.step, drafted=[self.token_text(t) for t in drafted],
            accepted=trace.accepted, rejected=[self.token_text(t) for t in rejected],
            target_token=self.token_text(own) if own is not None else "", kind=kind))
        return self

    @property
    def generated_tokens(self) -> int:
        return len(self.spans)

    def counts(self) -> metrics.SpecCounts:
        return counts_from_traces(self.traces, self.eos_ids)

    def highlighted(self):
        """The value of ``gr.HighlightedText``: a list of (text, label)."""
        return [(text, label) for text, label in self.spans if text]

    def step_log(self):
        return [row.as_list() for row in self.rows]

    def counters(self, seconds: float | None, baseline_tokens_per_s: float | None = None):
        return counters(self.counts(), self.generated_tokens, seconds, baseline_tokens_per_s,
                        steps=max(len(self.traces) - 1, 0))


def counters(counts: metrics.SpecCounts, generated_tokens: int, seconds: float | None,
             baseline_tokens_per_s: float | None = None, steps: int = 0) -> dict:
    """The live counters: acceptance length and rate (``worker.metrics``), tokens per second
    (generated tokens over the wall time so far) and the speedup over plain decoding."""
    tps = metrics.output_throughput(generated_tokens, seconds) if seconds else None
    return {
        "generated_tokens": generated_tokens,
        "steps": steps,
        **metrics.acceptance_figures(counts),
        "tokens_per_s": tps,
        "baseline_tokens_per_s": baseline_tokens_per_s,
        "speedup": metrics.speedup(tps, baseline_tokens_per_s),
    }


def _fmt(value, spec, none="–"):
    return none if value is None else format(value, spec)


def counters_markdown(c: dict, speedup_note: str | None = None) -> str:
    """A one-table summary of the counters for the demo page; ``speedup_note`` stands in
    for a speedup not known yet (plain decoding not measured)."""
    speedup = _fmt(c["speedup"], ".2f")
    if c["speedup"] is not None:
        speedup += "×"
    elif speedup_note:
        speedup = speedup_note
    alphas = ", ".join(f"{a:.2f}" for a in c["per_position_acceptance"]) or "–"
    return (
        "| acceptance length | acceptance rate | tokens/s | plain tokens/s | speedup |\n"
        "|---|---|---|---|---|\n"
        f"| {_fmt(c['acceptance_length'], '.2f')} | {_fmt(c['acceptance_rate'], '.1%')} "
        f"| {_fmt(c['tokens_per_s'], '.1f')} | {_fmt(c['baseline_tokens_per_s'], '.1f')} "
        f"| {speedup} |\n\n"
        f"{c['generated_tokens']} tokens in {c['steps']} steps; {c['drafts']} drafts, "
        f"{c['accepted_tokens']} of {c['draft_tokens']} drafted tokens accepted; "
        f"per-position acceptance: {alphas}"
    )
