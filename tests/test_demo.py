"""The live demo: the step -> highlight conversion and counters on a real generation of the
demo target, EAGLE and Medusa drafters trained and registered as train_drafter does them
running losslessly, the checks that give a person a clear message, the site's demo page,
and the Gradio app itself in headless Chromium.

This file runs in the main environment, which has no gradio (vllm needs pillow >= 13,
gradio < 13): it imports only demo.trace / demo.backend (no gradio there), and the browser test
starts the app from .venv-demo as a subprocess (`make install` creates it)."""
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.files.base import ContentFile
from django.test import RequestFactory

from demo import backend
from demo.trace import (ACCEPTED, BONUS, CORRECTED, TARGET, TraceView, counters, counters_markdown,
                        counts_from_traces, step_labels)
from leaderboard.models import Drafter, DrafterFile, Prompt, PromptSet, Target, TrainingDataset
from leaderboard.services.training import register_drafter
from worker import metrics
from worker.engines.reference import StepTrace
from worker.methods import make_proposer
from worker.processes import stop_process_group

from .conftest import ROOT, subprocess_env
# The training tests' cheap set-up: four conversations of the target, a recipe trained on
# them in a few steps, and a site with the target and a protocol (fixtures).
from .test_training import PROMPTS, dataset, site, target, train  # noqa: F401

EOS = 2
# Greedy SmolLM2 repeats this sentence, so prompt lookup finds drafts the target accepts.
REPEAT_PROMPT = "Repeat exactly, three times: the quick brown fox jumps over the lazy dog."


def trace(step, drafted, accepted, bonus, emitted=None, finished=False):
    if emitted is None:
        emitted = list(drafted[:accepted]) + ([bonus] if bonus is not None else [])
    return StepTrace(step=step, seq=0, drafted=list(drafted), accepted=accepted, bonus=bonus,
                     emitted=list(emitted), times={}, finished=finished)


def fake_view():
    vocab = {10: "A", 11: "b", 12: "c", 13: "d", 14: "e", 15: "f", EOS: "</s>"}
    decode = lambda ids: "".join(vocab[i] for i in ids if i != EOS)  # noqa: E731
    return TraceView(decode=decode, token_text=vocab.__getitem__, eos_ids=frozenset({EOS}))


def test_step_labels_tell_accepted_corrected_bonus_and_plain_tokens():
    assert step_labels(trace(0, [], 0, 10)) == [TARGET]  # the prefill: no draft
    assert step_labels(trace(1, [11, 12, 13, 14], 2, 15)) == [ACCEPTED, ACCEPTED, CORRECTED]
    assert step_labels(trace(2, [11, 12], 2, 13)) == [ACCEPTED, ACCEPTED, BONUS]
    assert step_labels(trace(3, [11, 12], 0, 13)) == [CORRECTED]
    # The budget cut the step short: the target's token was not emitted.
    assert step_labels(trace(4, [11, 12, 13], 3, 14, emitted=[11, 12])) == [ACCEPTED, ACCEPTED]


def test_counts_follow_the_metric_definitions_and_stop_at_eos():
    assert counts_from_traces([trace(0, [], 0, 10)]) == metrics.SpecCounts()
    c = counts_from_traces([trace(1, [11, 12, 13, 14], 2, 15)])
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_at) == (1, 4, 2, [1, 1, 0, 0])
    # The sequence ended inside the accepted draft: the drafted token after EOS is not counted.
    ended = trace(2, [11, EOS, 12], 2, None, finished=True)
    c = counts_from_traces([ended], eos_ids={EOS})
    assert (c.draft_tokens, c.accepted_tokens, c.accepted_at) == (2, 2, [1, 1])

    view = fake_view()
    for t in (trace(0, [], 0, 10), trace(1, [11, 12, 13, 14], 2, 15), trace(2, [11, 12], 2, 13),
              trace(3, [], 0, 14), ended):
        view.add(t)
    assert view.highlighted() == [
        ("A", TARGET), ("b", ACCEPTED), ("c", ACCEPTED), ("f", CORRECTED), ("b", ACCEPTED),
        ("c", ACCEPTED), ("d", BONUS), ("e", TARGET), ("b", ACCEPTED), ("</s>", ACCEPTED)]
    counts = view.counts()
    assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (3, 8, 6)
    c = view.counters(seconds=2.0, baseline_tokens_per_s=2.5)
    assert c["acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert c["acceptance_rate"] == pytest.approx(6 / 8)
    assert c["per_position_acceptance"] == pytest.approx([1.0, 1.0, 0.0, 0.0])
    assert c["tokens_per_s"] == pytest.approx(10 / 2.0)
    assert c["speedup"] == pytest.approx(5.0 / 2.5)
    log = view.step_log()
    assert log[1][3] == "'d' 'e'" and log[1][5] == CORRECTED  # the rejected drafts
    assert log[2][3] == "" and log[2][5] == BONUS
    assert log[4][3] == "" and log[4][5] == "end of sequence"
    table = counters_markdown(c)
    assert "| 3.00 | 75.0% | 5.0 | 2.5 | 2.00× |" in table


def test_counters_without_drafts_or_time_are_empty_not_zero():
    c = counters(metrics.SpecCounts(), generated_tokens=0, seconds=None)
    assert c["acceptance_length"] is None and c["tokens_per_s"] is None and c["speedup"] is None
    assert "| – | – | – | – | measuring |" in counters_markdown(c, "measuring")


@pytest.fixture(scope="module")
def demo_engine_loaded(demo_target_dir):
    return backend.get_engine(demo_target_dir)


@pytest.fixture(scope="module")
def engine(demo_engine_loaded, one_torch_thread):
    """The demo's own engine (one thread), which the training fixtures use too."""
    return demo_engine_loaded


def test_a_real_generation_streams_steps_that_become_highlights_and_counters(demo_engine_loaded):
    engine = demo_engine_loaded
    prompt_ids = backend.encode_prompt(engine, REPEAT_PROMPT, max_new_tokens=24, k=4,
                                  max_prompt_tokens=2048)
    proposer = make_proposer("ngram", prompt_lookup_min=2, prompt_lookup_max=4)
    view = TraceView(decode=engine.decode, token_text=lambda t: backend.token_text(engine, t),
                     eos_ids=frozenset(engine.eos_ids))
    updates = list(backend.stream_generation(engine, prompt_ids, proposer, k=4, max_new_tokens=24,
                                        temperature=0.0))
    for update in updates:
        for t in update.traces:
            view.add(t)
    result = updates[-1].result
    assert result is not None and updates[-1].error is None
    assert not any(u.done for u in updates[:-1])
    # Every step arrived, in order, and the view covers exactly the output.
    assert [t.step for t in view.traces] == [s.step for s in result.steps]
    assert view.generated_tokens == len(result.output_ids) > 0
    shown = "".join(text for text, _ in view.highlighted())
    special = backend.token_text(engine, result.output_ids[-1])
    assert shown in (result.text, result.text + special)

    labels = [label for _, label in view.spans]
    counts = view.counts()
    # Worked out from the engine's own traces, independently of demo.trace.
    drafted_steps = [s for s in result.steps if s.drafted]
    accepted = sum(s.accepted for s in drafted_steps)
    assert counts.drafts == len(drafted_steps) > 0
    assert counts.accepted_tokens == accepted > 0, "prompt lookup should hit on this prompt"
    assert labels.count(ACCEPTED) == accepted
    assert labels.count(CORRECTED) + labels.count(BONUS) == sum(
        1 for s in drafted_steps if s.bonus is not None and len(s.emitted) > s.accepted)
    assert labels[0] == TARGET  # the prefill's token
    for s, row in zip(result.steps, view.step_log()):
        assert row[0] == s.step and row[2] == s.accepted
        if s.drafted and s.bonus is not None:
            assert row[3] == " ".join(repr(backend.token_text(engine, t))
                                      for t in s.drafted[s.accepted:])

    baseline = backend.plain_decoding(engine, prompt_ids, 24)
    assert backend.plain_decoding(engine, prompt_ids, 24) is baseline  # cached per prompt
    assert baseline.output_ids == result.output_ids  # greedy speculative decoding is lossless
    c = view.counters(result.timings["wall"], baseline.tokens_per_s)
    assert c["acceptance_length"] == pytest.approx(1 + accepted / len(drafted_steps))
    # Drafted tokens after an EOS the target accepted are never counted (bonus is None then).
    assert c["acceptance_rate"] == pytest.approx(accepted / sum(
        len(s.drafted) if s.bonus is not None else s.accepted for s in drafted_steps))
    assert c["tokens_per_s"] == pytest.approx(len(result.output_ids) / result.timings["wall"])
    assert c["speedup"] == pytest.approx(c["tokens_per_s"] / baseline.tokens_per_s)


def test_closing_the_stream_stops_the_generation(demo_engine_loaded):
    engine = demo_engine_loaded
    prompt_ids = engine.encode_chat("Count from one to fifty.")
    stream = backend.stream_generation(engine, prompt_ids, None, k=4, max_new_tokens=200,
                                  temperature=0.0)
    first = next(stream)
    assert not first.done
    stream.close()
    # The engine is free again soon: the generation stopped at its next step.
    assert backend._engine_lock.acquire(timeout=30)
    backend._engine_lock.release()


def test_a_prompt_too_long_for_the_context_or_the_demo_is_refused(demo_engine_loaded):
    engine = demo_engine_loaded
    with pytest.raises(backend.DemoError, match="exceeds the model context of 8192 tokens"):
        backend.encode_prompt(engine, "hello " * 20, max_new_tokens=8190, k=4, max_prompt_tokens=0)
    with pytest.raises(backend.DemoError, match="at most 16"):
        backend.encode_prompt(engine, "hello " * 40, max_new_tokens=16, k=4, max_prompt_tokens=16)
    with pytest.raises(backend.DemoError, match="Type a prompt"):
        backend.encode_prompt(engine, "   ", max_new_tokens=16, k=4, max_prompt_tokens=16)


def test_a_huge_prompt_is_refused_by_its_length_before_it_is_tokenized(demo_engine_loaded):
    """#32 item 4: a 4 MiB prompt is refused at once, without tokenizing it (the tokenizer
    is not even called), and a prompt at the cap still is tokenized."""
    engine = demo_engine_loaded
    calls = []

    class Counting:
        path = engine.path

        def encode_chat(self, text):
            calls.append(len(text))
            return engine.encode_chat(text)

    huge = "word " * (4 << 18)   # 5 MiB
    with pytest.raises(backend.DemoError, match="at most 16000"):
        backend.encode_prompt(Counting(), huge, 16, 4, max_prompt_tokens=2048,
                              max_prompt_chars=16000)
    assert calls == []
    assert backend.encode_prompt(Counting(), "hello " * 100, 16, 4, max_prompt_tokens=2048,
                                 max_prompt_chars=16000)
    assert calls == [len(("hello " * 100).strip())]


def make_target(path, slug="demo-target"):
    return Target.objects.create(slug=slug, name="SmolLM2 demo", path=str(path),
                                 weights_sha256="0" * 64, vocab_size=49152, hidden_size=576,
                                 num_layers=30, has_chat_template=True)


@pytest.mark.django_db
def test_missing_target_or_drafter_files_give_a_clear_message(tmp_path, settings):
    settings.DATA_DIR = tmp_path / "data"
    target = make_target(tmp_path / "gone")
    with pytest.raises(backend.DemoError, match=r"checkpoint folder .*gone is missing"):
        backend.target_folder(target.slug)
    (tmp_path / "empty").mkdir()
    target.path = str(tmp_path / "empty")
    target.save()
    with pytest.raises(backend.DemoError, match=r"lacks config\.json, \*\.safetensors"):
        backend.target_folder(target.slug)

    no_files = Drafter.objects.create(slug="small", name="small draft", method="draft_model",
                                      target=target)
    with pytest.raises(backend.DemoError, match="small draft has no checkpoint folder"):
        backend.resolve_drafter("small", target.slug)
    lost = Drafter.objects.create(slug="lost", name="lost draft", method="draft_model",
                                  target=target, content_sha256="f" * 64)
    f = DrafterFile(drafter=lost, name="config.json", size=2, sha256="0" * 64)
    f.file.save("config.json", ContentFile(b"{}"), save=True)
    f.file.storage.delete(f.file.name)  # the storage lost it
    with pytest.raises(backend.DemoError, match="lost draft: its files cannot be read"):
        backend.resolve_drafter("lost", target.slug)
    Drafter.objects.create(slug="medusa", name="some heads", method="medusa", target=target)
    with pytest.raises(backend.DemoError, match="some heads has no checkpoint folder"):
        backend.resolve_drafter("medusa", target.slug)
    for method in ("eagle3", "mtp"):
        Drafter.objects.create(slug=method, name=f"a {method}", method=method, target=target)
        with pytest.raises(backend.DemoError, match=rf"a {method}: the demo's reference engine does "
                                               rf"not run {method} drafters .*with vLLM"):
            backend.resolve_drafter(method, target.slug)
    with pytest.raises(backend.DemoError, match="There is no target"):
        backend.target_folder("nope")


@pytest.mark.django_db
def test_choices_offer_runnable_drafters_and_prompts_by_set_and_category(tmp_path):
    target = make_target(tmp_path)
    Drafter.objects.create(slug="ng", name="ngram", method="ngram", target=target)
    Drafter.objects.create(slug="dm", name="draft", method="draft_model", target=target)
    Drafter.objects.create(slug="eg", name="eagle head", method="eagle", target=target)
    Drafter.objects.create(slug="md", name="medusa heads", method="medusa", target=target)
    Drafter.objects.create(slug="e3", name="eagle3", method="eagle3", target=target)
    Drafter.objects.create(slug="mt", name="mtp", method="mtp", target=target)
    Drafter.objects.create(slug="rj", name="rejected", method="ngram", target=target,
                           review_state="rejected")
    assert backend.drafter_choices(target.slug) == [
        ("draft [draft_model]", "dm"), ("eagle head [eagle]", "eg"),
        ("medusa heads [medusa]", "md"), ("ngram [ngram]", "ng")]
    ps = PromptSet.objects.create(slug="mt", name="MT-Bench", format="mt-bench",
                                  source_name="q.jsonl", source_sha256="0" * 64)
    for i, cat in enumerate(["writing", "math", "writing"]):
        Prompt.objects.create(prompt_set=ps, external_id=str(81 + i), position=i, category=cat,
                              turns=[f"question {i}", "follow-up"])
    assert backend.prompt_groups() == [("MT-Bench · math (1)", "mt/math"),
                                  ("MT-Bench · writing (2)", "mt/writing")]
    choices = backend.prompts_in_group("mt/writing")
    assert [label for label, _ in choices] == ["#81: question 0", "#83: question 2"]
    assert backend.prompt_text(choices[1][1]) == "question 2"


@pytest.mark.django_db
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_trained_heads_are_offered_and_decode_losslessly_in_the_demo(method, site, dataset, train,
                                                                     tmp_path):
    """A head trained as `train_drafter` does (few steps, overfitted on four conversations)
    and registered like it goes through the demo's own path: the picker, the files copied
    out of the storage, the proposer, the stream; greedy output equals the target's."""
    target_row, protocol = site
    data_path, data_sha = dataset
    data = TrainingDataset.objects.create(slug="tiny-chat", target=target_row, sha256=data_sha,
                                          n=len(PROMPTS), source=data_path.name,
                                          path=str(data_path))
    summary = train(method, tmp_path / method, 20, lr=2e-3)
    drafter, _ = register_drafter(summary, method, data, protocol, send=False)
    assert (f"{drafter.name} [{method}]", drafter.slug) in backend.drafter_choices(target_row.slug)

    engine = backend.get_engine(backend.target_folder(target_row.slug))
    choice = backend.resolve_drafter(drafter.slug, target_row.slug)
    assert choice.method == method and Path(choice.path, "model.safetensors").is_file()
    proposer = backend.get_proposer(choice)
    assert backend.get_proposer(choice) is proposer and proposer.method == method
    max_new_tokens, k = 16, 3
    prompt_ids = backend.encode_prompt(engine, PROMPTS[1], max_new_tokens, k, max_prompt_tokens=2048)
    updates = list(backend.stream_generation(engine, prompt_ids, proposer, k, max_new_tokens,
                                        temperature=0.0))
    result = updates[-1].result
    assert result is not None and updates[-1].error is None
    assert result.output_ids == backend.plain_decoding(engine, prompt_ids, max_new_tokens).output_ids
    view = TraceView(decode=engine.decode, token_text=lambda t: backend.token_text(engine, t),
                     eos_ids=frozenset(engine.eos_ids))
    for update in updates:
        for t in update.traces:
            view.add(t)
    counts = view.counts()
    # Overfitted on this conversation, the head drafts tokens the target accepts.
    assert counts.drafts > 0 and counts.draft_tokens >= counts.drafts
    assert counts.accepted_tokens > 0, [(s.drafted, s.accepted) for s in result.steps]
    assert ACCEPTED in [label for _, label in view.highlighted()]


def test_demo_page_embeds_the_gradio_app(settings):
    from leaderboard.views import demo_page

    settings.SPECBOARD_DEMO_URL = "http://demo.example:7999/"
    request = RequestFactory().get("/demo/")
    request.user = AnonymousUser()
    html = demo_page(request).content.decode()
    assert '<iframe src="http://demo.example:7999/"' in html
    assert 'href="http://demo.example:7999/"' in html


# ---- the Gradio app in a browser -------------------------------------------------------

# The demo's own environment; SPECBOARD_DEMO_PYTHON names another (a git worktree without
# its own .venv-demo).
DEMO_PYTHON = Path(os.environ.get("SPECBOARD_DEMO_PYTHON")
                   or ROOT / ".venv-demo" / "bin" / "python")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url, proc, log_path, seconds=240):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the demo exited with code {proc.returncode}:\n"
                        f"{Path(log_path).read_text(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the demo did not answer at {url} within {seconds}s:\n"
                f"{Path(log_path).read_text(errors='replace')[-4000:]}")


@pytest.fixture
def demo_server(tmp_path):
    if not DEMO_PYTHON.exists():
        pytest.fail(f"{DEMO_PYTHON} is missing: the demo runs from its own environment "
                    "(gradio cannot live beside vllm); run `make install` to create it")
    port = free_port()
    log_path = tmp_path / "demo.log"
    env = subprocess_env(GRADIO_ANALYTICS_ENABLED="False")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(DEMO_PYTHON), "manage.py", "demo", "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for_http(url, proc, log_path)
        yield url, log_path
    finally:
        stop_process_group(proc, term_timeout=20, kill_timeout=10)


@pytest.fixture
def demo_rows(demo_target_dir):
    target = make_target(demo_target_dir, slug="smollm2-135m-instruct")
    Drafter.objects.create(slug="ngram-prompt-lookup", name="n-gram prompt lookup",
                           method="ngram", target=target,
                           params={"prompt_lookup_min": 2, "prompt_lookup_max": 4})
    ps = PromptSet.objects.create(slug="mt-bench", name="MT-Bench", format="mt-bench",
                                  source_name="question.jsonl", source_sha256="0" * 64)
    Prompt.objects.create(prompt_set=ps, external_id="81", position=0, category="writing",
                          turns=[REPEAT_PROMPT, "Now in French."])
    return target


def pick_option(page, dropdown_id, option_text):
    page.locator(f"#{dropdown_id} input").click()
    page.get_by_role("option", name=option_text).first.click()


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_demo_in_a_browser_streams_highlighted_tokens_and_counters(demo_rows, demo_server,
                                                                  artifacts_dir,
                                                                  screenshots_dir):
    from .conftest import chromium_page

    url, log_path = demo_server
    demo_log = lambda: Path(log_path).read_text(errors="replace")[-4000:]  # noqa: E731
    with chromium_page(viewport=(1280, 1300), bypass_csp=False) as page:
        page.set_default_timeout(30000)
        try:
            page.goto(url)
            # The choices come from the test database when the page loads.
            page.wait_for_function(
                "document.querySelector('#target input')?.value.includes('smollm2')",
                timeout=60_000)
            assert "n-gram prompt lookup" in page.locator("#drafter input").input_value()
            # A prompt from a task's prompt set, by set and category.
            pick_option(page, "prompt-group", "MT-Bench · writing (1)")
            pick_option(page, "prompt-pick", "#81")
            page.wait_for_function(
                "document.querySelector('#prompt textarea').value.startsWith('Repeat exactly')",
                timeout=30_000)
            max_tokens = page.locator("#max-new-tokens input[type=number]")
            max_tokens.fill("20")
            max_tokens.press("Enter")
            page.locator("#generate").click()
            page.wait_for_function(
                "document.querySelector('#demo-status')?.innerText.includes('Done')",
                timeout=300_000)
            status = page.locator("#demo-status").inner_text()
            spans = page.locator("#output .token.highlighted")
            n_spans = spans.count()
            styles = [spans.nth(i).get_attribute("style") for i in range(n_spans)]
            counter_cells = page.locator("#counters td").all_inner_texts()
            step_log = page.locator("#step-log").inner_text()
            # the README's screenshot (tests/conftest.py: screenshots_dir)
            page.screenshot(path=str(screenshots_dir / "demo.png"))
        except Exception as e:  # noqa: BLE001 - show what the page and the demo said
            page.screenshot(path=str(artifacts_dir / "demo-failed.png"), full_page=True)
            pytest.fail(f"{type(e).__name__}: {e}\nscreenshot: {artifacts_dir / 'demo-failed.png'}"
                        f"\ndemo log:\n{demo_log()}")
    assert "Output identical to plain greedy decoding" in status, (status, demo_log())
    tokens = int(re.search(r"Done:\*?\*? ?(\d+) tokens", status).group(1))
    assert 3 <= n_spans <= tokens <= 20
    # Accepted drafts (green) and the target's own tokens are both there.
    assert any("134, 239, 172" in (s or "") for s in styles), styles
    assert any("134, 239, 172" not in (s or "") for s in styles), styles
    al, rate, tps, plain_tps, speedup = counter_cells[:5]
    assert float(al) > 1.0 and re.fullmatch(r"\d+\.\d%", rate), counter_cells
    assert float(tps) > 0 and float(plain_tps) > 0, counter_cells
    assert re.fullmatch(r"\d+\.\d\d×", speedup), counter_cells
    # The step log lists the steps with where the target's token came from.
    assert "rejected" in step_log and "target" in step_log, step_log
    assert "bonus" in step_log or "corrected" in step_log, step_log
    assert (screenshots_dir / "demo.png").stat().st_size > 20_000


def _post(url, path, body, source):
    import http.client
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60,
                                      source_address=(source, 0))
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode(errors="replace")


def join_queue(url, session, source="127.0.0.1"):
    """A generation asked of the live demo's queue as its page asks, from ``source`` (a
    loopback address of its own: one client): the page's load (which fills the target and
    drafter choices of this session), then POST /gradio_api/queue/join for Generate."""
    status, text = _post(url, "/gradio_api/run/predict", {
        "data": [], "event_data": None, "fn_index": 0, "trigger_id": None,
        "session_hash": session}, source)
    assert status == 200, (status, text)
    return _post(url, "/gradio_api/queue/join", {
        "data": ["smollm2-135m-instruct", "ngram-prompt-lookup", REPEAT_PROMPT, 4, 0.0, 64, 0],
        "event_data": None, "fn_index": 4, "trigger_id": 17, "session_hash": session}, source)


@pytest.mark.django_db(transaction=True)
def test_one_client_cannot_hold_the_demo_queue(demo_rows, demo_server, monkeypatch):
    """#32 item 4: a client may have SPECBOARD_DEMO_PER_CLIENT (2) generations waiting or
    running; its next is turned away with a sentence, while another client still gets in.
    (fn_index 4 / trigger 17 are the Generate button's, demo/app.py.)"""
    url, log_path = demo_server
    answers = [join_queue(url, f"hog-{i}") for i in range(4)]
    assert [status for status, _ in answers[:2]] == [200, 200], answers
    assert all(status == 503 and "2 generations waiting or running" in text
               for status, text in answers[2:]), answers
    status, text = join_queue(url, "someone-else", source="127.0.0.2")
    assert status == 200 and "event_id" in text, (status, text)
