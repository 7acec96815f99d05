"""The Gradio live demo (`python manage.py demo`, from .venv-demo): speculative decoding step
by step on the reference engine, for a target and a drafter of the leaderboard.

The output streams in a ``gr.HighlightedText``: accepted draft tokens, the target's
corrected or bonus token in other colours; the step log lists what was drafted and what the
target rejected; the counters show acceptance length and rate (``worker.metrics``), tokens
per second, and the speedup over plain decoding of the same prompt (run once, cached).

Everything but the Gradio layout lives in ``demo/backend.py`` and ``demo/trace.py``, which
the main environment (no gradio) tests.
"""
from __future__ import annotations

import os
from functools import partial

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # never phone home; set before the import

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402  (a gradio dependency)
from django.conf import settings  # noqa: E402
from django.db import close_old_connections  # noqa: E402

from . import backend
from .client_limit import limit_per_client  # noqa: E402
from .trace import COLORS, STEP_LOG_HEADERS, TraceView, counters_markdown  # noqa: E402

DEFAULT_TARGET = "smollm2-135m-instruct"
# Least time between two redraws while generating: every redraw costs the generating
# thread CPU (and the GIL), which would lower the tokens/s the demo measures.
MIN_UPDATE_S = 0.3
INTRO = """
# SpecBoard live demo
Speculative decoding, step by step, on the reference torch engine (CPU, one request at a
time). Each step the **drafter** proposes up to *k* tokens and the **target** checks them in
one forward pass: it keeps the longest prefix it agrees with and adds one token of its own.
Colours: **accepted** draft tokens, the target's **corrected** token (after a rejection) or
**bonus** token (after a fully accepted draft), and **target** (no draft that step). The
step log lists every draft and the tokens the target **rejected**.
"""
LIMITS = """
*Shared fairly:* one generation runs at a time; each visitor may have {per_client}
generations waiting or running; a prompt may have {chars} characters and {tokens} tokens.
"""
CSS = """
#demo-status .prose, #demo-status { font-size: 0.95rem; }
#output .textspan { white-space: pre-wrap; }
"""


def _theme():
    # System fonts: the page must not fetch anything from outside (no font CDN).
    fonts = ["ui-sans-serif", "system-ui", "sans-serif"]
    mono = ["ui-monospace", "SFMono-Regular", "Menlo", "monospace"]
    return gr.themes.Default(font=fonts, font_mono=mono)


def _steps_frame(rows):
    return pd.DataFrame(rows, columns=STEP_LOG_HEADERS)


# ---- event handlers ----------------------------------------------------------------

def load_choices():
    close_old_connections()
    try:
        targets = backend.target_choices()
        slugs = [slug for _, slug in targets]
        target = DEFAULT_TARGET if DEFAULT_TARGET in slugs else (slugs[0] if slugs else None)
        drafters = backend.drafter_choices(target) if target else []
        groups = backend.prompt_groups()
    finally:
        close_old_connections()
    return (gr.Dropdown(choices=targets, value=target),
            gr.Dropdown(choices=drafters, value=drafters[0][1] if drafters else None),
            gr.Dropdown(choices=groups, value=None))


def drafters_for(target_slug):
    close_old_connections()
    try:
        drafters = backend.drafter_choices(target_slug) if target_slug else []
    finally:
        close_old_connections()
    if target_slug and not drafters:
        gr.Warning("This target has no drafter the demo's reference engine runs "
                   f"({', '.join(backend.SUPPORTED_METHODS)}).")
    return gr.Dropdown(choices=drafters, value=drafters[0][1] if drafters else None)


def prompts_for(group):
    close_old_connections()
    try:
        prompts = backend.prompts_in_group(group)
    finally:
        close_old_connections()
    return gr.Dropdown(choices=prompts, value=None)


def fill_prompt(prompt_id, current):
    if prompt_id in (None, ""):
        return current
    close_old_connections()
    try:
        return backend.prompt_text(prompt_id) or current
    finally:
        close_old_connections()


def _error(message):
    gr.Warning(message)
    return ([], "", _steps_frame([]), f"**Error:** {message}")


def generate(target_slug, drafter_slug, prompt, k, temperature, max_new_tokens, seed):
    """Stream one generation: (highlighted output, counters, step log, status) per update."""
    k, max_new_tokens = int(k), int(max_new_tokens)
    temperature, seed = float(temperature), int(seed or 0)
    if not 1 <= k <= 16 or not 1 <= max_new_tokens <= settings.DEMO_MAX_NEW_TOKENS:
        yield _error(f"k must be 1..16 and max new tokens 1..{settings.DEMO_MAX_NEW_TOKENS}.")
        return
    close_old_connections()
    try:
        if not target_slug:
            raise backend.DemoError("Pick a target.")
        if not drafter_slug:
            raise backend.DemoError("Pick a drafter (this target has none the demo runs?).")
        folder = backend.target_folder(target_slug)
        choice = backend.resolve_drafter(drafter_slug, target_slug)
        if not backend.engine_loaded(folder):
            yield ([], "", _steps_frame([]), "Loading the target (once per target)…")
        engine = backend.get_engine(folder)
        proposer = backend.get_proposer(choice)
        prompt_ids = backend.encode_prompt(engine, prompt, max_new_tokens, k,
                                           settings.DEMO_MAX_PROMPT_TOKENS,
                                           settings.DEMO_MAX_PROMPT_CHARS)
    except backend.DemoError as e:
        yield _error(str(e))
        return
    finally:
        close_old_connections()

    # A leaderboard measurement on this host holds the host lock: wait for it to finish
    # (SPECBOARD_DEMO_HOST_WAIT_S), else generate anyway and label the timings.
    from worker import hostlock

    contended = False
    if hostlock.is_held(settings.HOST_LOCK):
        yield ([], "", _steps_frame([]),
               f"Waiting for a measurement to finish (up to {settings.DEMO_HOST_WAIT_S} s)…")
        contended = backend.host_contended(settings.HOST_LOCK, settings.DEMO_HOST_WAIT_S)
    note = f"\n\n**{backend.CONTENTION_NOTE}**" if contended else ""
    view = TraceView(decode=engine.decode, token_text=partial(backend.token_text, engine),
                     eos_ids=frozenset(engine.eos_ids))
    baseline = backend.cached_baseline(engine, prompt_ids, max_new_tokens)
    base_tps = baseline.tokens_per_s if baseline else None
    yield ([], "", _steps_frame([]),
           f"Generating with {choice.name} (k={k}, temperature {temperature:g}; "
           f"prompt {len(prompt_ids)} tokens)…")
    update, last_shown = None, -MIN_UPDATE_S
    for update in backend.stream_generation(engine, prompt_ids, proposer, k, max_new_tokens,
                                       temperature, seed):
        for trace in update.traces:
            view.add(trace)
        if update.error is not None:
            yield _error(f"the generation failed: {type(update.error).__name__}: {update.error}")
            return
        if update.done:
            break
        if update.seconds - last_shown < MIN_UPDATE_S:
            continue  # the page is redrawn a few times a second, not at every step
        last_shown = update.seconds
        counters = view.counters(update.seconds, base_tps)
        yield (view.highlighted(),
               counters_markdown(counters, None if base_tps else "after the generation") + note,
               _steps_frame(view.step_log()),
               f"Generating… step {len(view.traces) - 1}, {view.generated_tokens} tokens")
    if update is None or update.result is None:
        return
    result = update.result
    wall = result.timings["wall"]
    if baseline is None:
        counters = view.counters(wall, None)
        yield (view.highlighted(), counters_markdown(counters, "measuring plain decoding…"),
               _steps_frame(view.step_log()),
               "Measuring plain decoding of the same prompt (once per prompt)…")
        baseline = backend.plain_decoding(engine, prompt_ids, max_new_tokens)
    counters = view.counters(wall, baseline.tokens_per_s)
    status = (("**Timings measured under contention.** " if contended else "")
              + f"**Done:** {view.generated_tokens} tokens in {wall:.2f} s "
              f"({result.finish_reason}); plain decoding {len(baseline.output_ids)} tokens in "
              f"{baseline.seconds:.2f} s.")
    if temperature == 0:
        same = list(result.output_ids) == list(baseline.output_ids)
        status += (" Output identical to plain greedy decoding." if same else
                   " Output differs from plain greedy decoding (numerical ties).")
    yield (view.highlighted(), counters_markdown(counters) + note, _steps_frame(view.step_log()),
           status)


# ---- layout ----------------------------------------------------------------------------

def build_app() -> gr.Blocks:
    with gr.Blocks(title="SpecBoard live demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO + LIMITS.format(per_client=settings.DEMO_PER_CLIENT,
                                          chars=settings.DEMO_MAX_PROMPT_CHARS,
                                          tokens=settings.DEMO_MAX_PROMPT_TOKENS))
        with gr.Row():
            target = gr.Dropdown(label="Target", choices=[], elem_id="target")
            drafter = gr.Dropdown(label="Drafter", choices=[], elem_id="drafter")
        with gr.Row():
            group = gr.Dropdown(label="Prompt set · category", choices=[], elem_id="prompt-group")
            pick = gr.Dropdown(label="Prompt from the set", choices=[], elem_id="prompt-pick")
        prompt = gr.Textbox(label=f"Prompt (at most {settings.DEMO_MAX_PROMPT_CHARS} "
                                  f"characters, {settings.DEMO_MAX_PROMPT_TOKENS} tokens)",
                            lines=4, elem_id="prompt", max_length=settings.DEMO_MAX_PROMPT_CHARS,
                            placeholder="Type a prompt, or pick one from a prompt set above")
        with gr.Row():
            k = gr.Slider(1, 8, value=4, step=1, label="k (tokens drafted per step)",
                          elem_id="k")
            temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature",
                                    elem_id="temperature")
            max_new_tokens = gr.Slider(8, settings.DEMO_MAX_NEW_TOKENS, value=64, step=1,
                                       label="max new tokens", elem_id="max-new-tokens")
            seed = gr.Number(value=0, precision=0, label="seed", elem_id="seed")
        button = gr.Button("Generate", variant="primary", elem_id="generate")
        status = gr.Markdown(elem_id="demo-status")
        counters = gr.Markdown(elem_id="counters")
        output = gr.HighlightedText(label="Output (colour = where each token came from)",
                                    color_map=COLORS, show_legend=True,
                                    combine_adjacent=False, elem_id="output")
        steps = gr.Dataframe(headers=STEP_LOG_HEADERS, label="Step log", elem_id="step-log",
                             interactive=False, wrap=True, max_height=420)

        app.load(load_choices, outputs=[target, drafter, group], queue=False)
        target.change(drafters_for, target, drafter, queue=False)
        group.change(prompts_for, group, pick, queue=False)
        pick.change(fill_prompt, [pick, prompt], prompt, queue=False)
        # trigger_mode="once": a page has at most one generation queued or running.
        button.click(generate, [target, drafter, prompt, k, temperature, max_new_tokens, seed],
                     [output, counters, steps, status], concurrency_limit=1,
                     concurrency_id="engine", trigger_mode="once")
        prompt.submit(generate, [target, drafter, prompt, k, temperature, max_new_tokens, seed],
                      [output, counters, steps, status], concurrency_limit=1,
                      concurrency_id="engine", trigger_mode="once")
    # One generation at a time; a bounded waiting line; no API calls around the queue.
    app.queue(default_concurrency_limit=1, max_size=settings.DEMO_QUEUE_SIZE, api_open=False)
    limit_per_client(app, settings.DEMO_PER_CLIENT)
    return app


def launch(app: gr.Blocks, host: str, port: int):
    return app.launch(server_name=host, server_port=port, share=False, inbrowser=False,
                      show_error=True, quiet=True, ssr_mode=False, mcp_server=False,
                      theme=_theme(), css=CSS, footer_links=["gradio"])
