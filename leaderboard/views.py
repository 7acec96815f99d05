"""Pages. Function views: reads go through selectors, writes through services
(submissions, tokens, runs)."""
from __future__ import annotations

import functools
import hashlib
import sys
import time

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.cache import cache
from django.db import InterfaceError, OperationalError
from django.http import (FileResponse, Http404, HttpResponse, HttpResponseServerError,
                         JsonResponse, QueryDict)
from django.shortcuts import get_object_or_404, redirect, render
from django.template import loader
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST
from django_ratelimit.decorators import ratelimit

from worker import analysis
from worker.checkpoint import Upload

from . import charts, pays, permissions, tokens
from .selectors import accounts, board, drafters, protocols, shapes
from .selectors import history as history_reads
from .selectors import recipes as recipe_reads
from .selectors import runs as run_reads
from .selectors import submissions as submission_reads
from .services import intake, submissions
from .forms import DrafterEditForm, SignupForm, SubmitForm, TokenForm
from .models import Drafter, Run, Submission


# ---- query parameters --------------------------------------------------------------------

def _int(value, allowed=None):
    try:
        v = int(value)
    except (TypeError, ValueError):
        return None
    return v if allowed is None or v in allowed else None


def _float(value, allowed=None):
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if allowed is None or v in allowed else None


def _query(params: list[tuple[str, str]], **changes):
    """The leaderboard's query string: ``params`` (the request's parameters as validated,
    ``board_params``) with some changed (None removes one)."""
    q = QueryDict(mutable=True)
    for k, v in params:
        q[k] = v
    for k, v in changes.items():
        if v is None:
            q.pop(k, None)
        else:
            q[k] = v
    return "?" + q.urlencode() if q else "?"


# ---- fragment cache --------------------------------------------------------------------

def cached_fragment(page: tuple, signature, build):
    """The leaderboard table and the drafter page's results are rendered once per state of
    the data for each `page` (its parameters) and kept in Django's cache for
    SPECBOARD_PAGE_CACHE_SECONDS (0 = no cache). `signature()` gives the state as (settled,
    landing): what shows at once (runs succeeding, drafters withdrawn), and the progress of
    running runs. `build()` returns a dict with "html".

    With SPECBOARD_PAGE_CACHE_INCREMENTAL (default): while only cells land, a page's
    rendering is reused for SPECBOARD_LANDING_REFRESH_S, so a page is rendered at most that
    often however fast cells land; and when a new state is rendered, requests for the same
    page that come meanwhile get its previous rendering rather than all rendering it."""
    ttl = settings.SPECBOARD_PAGE_CACHE_SECONDS
    if ttl <= 0:
        return build()
    settled, landing = signature()
    settled_digest = hashlib.sha256(repr((page, settled)).encode()).hexdigest()
    latest = "fragment-latest:" + hashlib.sha256(repr(page).encode()).hexdigest()
    key = "fragment:" + hashlib.sha256(repr((settled_digest, landing)).encode()).hexdigest()
    value = cache.get(key)
    if value is not None:
        return value
    incremental = settings.SPECBOARD_PAGE_CACHE_INCREMENTAL
    previous = cache.get(latest) if incremental else None
    if previous is not None and previous["settled"] == settled_digest and (
            time.time() - previous["at"] < settings.SPECBOARD_LANDING_REFRESH_S):
        return previous["value"]
    rendering = key + ":rendering"
    if incremental and not cache.add(rendering, True, FRAGMENT_RENDER_S):
        if previous is not None:
            return previous["value"]
    try:
        value = build()
        kept = {k: v for k, v in value.items() if k == "html" or k.startswith("meta")}
        cache.set_many({key: kept, latest: {"settled": settled_digest, "at": time.time(),
                                            "value": kept}}, ttl)
    finally:
        cache.delete(rendering)
    return value


# How long other requests may be answered with a page's previous rendering while one
# renders its new state (then they render it too: the renderer may have died).
FRAGMENT_RENDER_S = 20


def protocol_choices():
    """The protocols with results for the pages' protocol menus (cached for a short while:
    a protocol's first result shows in the menu within 30 seconds)."""
    def build():
        return [{"pk": p.pk, "slug": p.slug, "version": p.version,
                 "target": {"name": p.target.name}} for p in protocols.protocols_with_results()]
    if settings.SPECBOARD_PAGE_CACHE_SECONDS <= 0:
        return build()
    return cache.get_or_set("protocol-choices", build, min(30, settings.SPECBOARD_PAGE_CACHE_SECONDS))


# ---- leaderboard ---------------------------------------------------------------------

ROWS_PER_PAGE = 100
COLUMNS = [("name", "Drafter"), ("method", "Method"), ("k", "k"), ("batch_size", "Batch"),
           ("temperature", "Temp."), ("acceptance_length", "Acceptance length"),
           ("tokens_per_step", "Tokens/step"),
           ("acceptance_rate", "Acceptance rate"), ("output_throughput", "Throughput (tok/s)"),
           ("speedup", "Speedup"), ("lossless_share", "Lossless")]


@require_GET
def home(request):
    protocol = protocols.get_protocol(request.GET.get("protocol"), request.GET.get("target"))
    if protocol is None:
        if request.GET.get("protocol"):
            raise Http404("no such protocol")
        return render(request, "leaderboard/home.html", {"protocol": None})
    spec = protocol.spec
    # The state of the board's runs, read at most once: for the default batch size (the
    # smallest with rows) and for the fragment cache.
    signature = functools.cache(lambda: board.leaderboard_signature(protocol))
    t_param, b_param = request.GET.get("temperature"), request.GET.get("batch_size")
    chosen = board.resolve_filters(
        protocol, task=request.GET.get("task") or None, batch_size=b_param or None,
        temperature=t_param or None, k=request.GET.get("k") or None,
        method=request.GET.get("method") or None, lenient=True, signature=signature)
    task, batch_size, temperature = chosen["task"], chosen["batch_size"], chosen["temperature"]
    k, method = chosen["k"], chosen["method"]
    sort = request.GET.get("sort") or "speedup"
    sort = sort if sort in board.SORT_KEYS else "speedup"
    descending = request.GET.get("dir", "desc") != "asc"
    page = max(_int(request.GET.get("page")) or 1, 1)
    # The parameters as validated: the links and the cache key carry only these, so an
    # unknown value can neither reach a link nor add a cache entry.
    params = []
    if request.GET.get("protocol"):
        params.append(("protocol", shapes.protocol_ref(protocol)))
    elif request.GET.get("target"):
        params.append(("target", protocol.target.slug))
    for name, value, given in (
            ("task", task, True),
            ("batch_size", "all" if batch_size is None else str(batch_size),
             b_param == "all" or _int(b_param, spec.batch_sizes) is not None),
            ("temperature", "all" if temperature is None else f"{temperature:g}",
             t_param == "all" or _float(t_param, spec.temperatures) is not None),
            ("k", k, True), ("method", method, True),
            ("sort", sort, request.GET.get("sort") == sort),
            ("dir", request.GET.get("dir"), request.GET.get("dir") in ("asc", "desc"))):
        if given and value is not None:
            params.append((name, str(value)))
    headers = []
    for key, label in COLUMNS:
        active = sort == key
        headers.append({"key": key, "label": label, "active": active,
                        "dir": "desc" if descending else "asc",
                        "url": _query(params, sort=key,
                                      dir="asc" if active and descending else "desc", page=None)})
    filters = dict(task=task, batch_size=batch_size, temperature=temperature, k=k,
                   method=method, sort=sort, descending=descending)

    def build(n):
        table = board.leaderboard(protocol, **filters)
        total = len(table["rows"])
        pages = max(1, -(-total // ROWS_PER_PAGE))
        n = min(max(n, 1), pages)
        offset = (n - 1) * ROWS_PER_PAGE
        table["rows"] = table["rows"][offset:offset + ROWS_PER_PAGE]
        pager = {"page": n, "pages": pages, "total": total, "offset": offset,
                 "prev": _query(params, page=n - 1) if n > 1 else None,
                 "next": _query(params, page=n + 1) if n < pages else None}
        html = render_to_string("leaderboard/_board.html", {
            "board": table, "headers": headers, "pager": pager, "p": table["protocol"]})
        return {"html": html, "board": table, "meta_rows": total, "meta_pages": pages}

    def fragment_of(n):
        return cached_fragment(("board", protocol.pk, sorted(filters.items()), n, params),
                               signature, lambda: build(n))

    if page > 1 and settings.SPECBOARD_PAGE_CACHE_SECONDS > 0:
        # A page past the last is the last: one cache entry per page that exists (the
        # first page, cached too, knows how many there are).
        page = min(page, fragment_of(1)["meta_pages"])
    fragment = fragment_of(page)
    ref = shapes.protocol_ref(protocol)
    # An empty board says what is measuring, and what comes next (not cached: ETAs move).
    measuring = run_reads.active_runs(protocol=protocol) if not fragment["meta_rows"] else []
    return render(request, "leaderboard/home.html", {
        "measuring": measuring,
        "protocol": shapes.protocol_summary(protocol), "board_html": fragment["html"],
        "board": fragment.get("board"), "filters": filters,
        "protocols": protocol_choices(), "protocol_ref": ref,
        "methods": Drafter.METHODS, "ks": spec.ks, "tasks": spec.task_names,
        "batch_sizes": spec.batch_sizes, "temperatures": spec.temperatures,
        "b_param": "all" if batch_size is None else str(batch_size),
        "t_param": "all" if temperature is None else f"{temperature:g}",
        "compare_url": reverse("compare") + f"?protocol={ref}",
    })


# ---- drafters -------------------------------------------------------------------------

@require_GET
def drafter_detail(request, slug):
    overview = drafters.drafter_overview(slug, request.GET.get("protocol"))
    if overview is None or not permissions.can_see(request.user,
                                                    overview["drafter"]["review_state"]):
        raise Http404("no such drafter")
    page = {k: v for k, v in overview.items() if not k.startswith("_")}
    # Only values the protocol has reach the rendering and its cache key.
    shown = page.get("protocol") or {}
    k_param = _int(request.GET.get("k"), shown.get("ks") or ())
    t_param = _float(request.GET.get("temperature"), shown.get("temperatures") or ())

    def build():
        full = {**page, **drafters.drafter_results(overview)}
        figs, k, temperature = {}, None, None
        protocol = full["protocol"]
        if protocol and full["cells"]:
            temps = protocol["temperatures"]
            temperature = _float(t_param, temps)
            temperature = temps[0] if temperature is None else temperature
            k = _int(k_param, protocol["ks"]) or charts.best_k(
                [c for c in full["cells"] if c["temperature"] == temperature],
                [c for c in full["baseline_cells"] if c["temperature"] == temperature],
                protocol["ks"])
            figs = charts.drafter_charts(full, k, temperature)
        analysed = pays.drafter_analysis(full) if full["cells"] else None
        if analysed and figs:
            figs.update(charts.drafter_pays_charts(analysed, k, temperature))
        html = render_to_string("leaderboard/_drafter_results.html", {
            "page": full, "figs": figs, "k": k, "temperature": temperature, "pays": analysed})
        return {"html": html, "meta_has_charts": bool(figs), "page": full}

    if overview["_run"] is None:
        fragment = build()
    else:
        fragment = cached_fragment(("drafter", overview["_run"].pk, k_param, t_param),
                                   lambda: drafters.drafter_signature(overview), build)
    manage = permissions.can_manage(request.user, page["drafter"]["owner_id"],
                                    page["drafter"]["review_state"])
    # The shown run (or the run re-measuring it) still queued or running: what it measures
    # next and its ETA, as the queue shows them (not cached: ETAs move).
    active = [r["id"] for r in (page["run"], page["remeasuring"])
              if r and r["state"] in (Run.QUEUED, Run.RUNNING)]
    return render(request, "leaderboard/drafter.html", {
        "measuring": run_reads.active_runs(
            run_ids=active, show_rejected=permissions.sees_rejected(request.user))
        if active else [],
        "page": fragment.get("page", page), "d": page["drafter"],
        "results_html": fragment["html"], "can_manage": manage,
        "has_charts": fragment["meta_has_charts"],
        "submission": submission_reads.accepted_for(page["drafter"]["id"]),
        # its engine versions (one query; only drafters with a succeeded run have any)
        "history": history_reads.drafter_history(slug)
        if any(r["state"] == Run.SUCCEEDED for r in page["runs"]) else None,
    })


@login_required
def drafter_edit(request, slug):
    drafter = get_object_or_404(Drafter, slug=slug)
    if not permissions.can_see(request.user, drafter.review_state):
        raise Http404("no such drafter")   # a 403 would confirm that it exists
    if not permissions.can_manage_drafter(request.user, drafter):
        raise PermissionDenied("only the owner or staff may edit this drafter")
    form = DrafterEditForm(request.POST or None, instance=drafter)
    if request.method == "POST" and form.is_valid():
        submissions.update_drafter(drafter, **form.cleaned_data)
        messages.success(request, "Saved.")
        return redirect("drafter", slug=drafter.slug)
    return render(request, "leaderboard/drafter_edit.html", {"form": form, "drafter": drafter})


@login_required
@require_POST
def drafter_withdraw(request, slug):
    drafter = get_object_or_404(Drafter, slug=slug)
    if not permissions.can_see(request.user, drafter.review_state):
        raise Http404("no such drafter")
    if not permissions.can_manage_drafter(request.user, drafter):
        raise PermissionDenied("only the owner or staff may withdraw this drafter")
    n = submissions.withdraw_drafter(drafter)
    if n is None:   # rejected by staff since the page was loaded
        raise Http404("no such drafter")
    messages.success(request, f"{drafter.name} is withdrawn from the leaderboard"
                     + (f"; {n} unfinished run(s) cancelled." if n else "."))
    return redirect("drafter", slug=drafter.slug)


# ---- submit ---------------------------------------------------------------------------

@login_required
def submit(request):
    """Only what is cheap is checked here (the form, the parameters, the daily limit); the
    files are staged and checked by the intake worker (leaderboard/services/intake.py),
    whose progress the submission's page shows."""
    form = SubmitForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        uploads = [Upload(f.name, f, f.size) for f in data["files"]]
        try:
            submission = intake.receive(
                owner=request.user, protocol=data["protocol"], method=data["method"],
                name=data["name"], uploads=uploads, hub_reference=data["hub_reference"],
                params=form.params(), description=data["description"], link=data["link"],
                licence=data["licence"],
                claimed_acceptance_length=data["claimed_acceptance_length"],
                claimed_speedup=data["claimed_speedup"], claimed_source=data["claimed_source"])
        except submissions.SubmissionRefused as e:
            form.add_problems(e.problems)
        else:
            messages.success(request, f"{submission.name} is received and being checked; "
                                      "this page follows the checks.")
            return redirect("submission", pk=submission.pk)
        status = 400
    else:
        status = 400 if request.method == "POST" else 200
    return render(request, "leaderboard/submit.html", {"form": form}, status=status)


@login_required
@require_GET
def submission_detail(request, pk):
    submission = submission_reads.for_viewer(request.user, pk)
    if submission is None:
        raise Http404("no such submission")   # another's: a 403 would confirm it exists
    return render(request, "leaderboard/submission.html",
                  {"s": submission_reads.summary(submission, viewer=request.user)})


@login_required
@require_GET
def submission_list(request):
    return render(request, "leaderboard/submissions.html",
                  {"submissions": submission_reads.of_owner(request.user),
                   "checking": submission_reads.checking_count()})


# ---- queue --------------------------------------------------------------------------

@require_GET
def queue(request):
    hardware = request.GET.get("hardware") or None
    data = run_reads.queue(hardware=hardware,
                           show_rejected=permissions.sees_rejected(request.user))
    user = request.user
    for r in data["active"] + data["finished"]:
        r["can_cancel"] = (r["state"] in (Run.QUEUED, Run.RUNNING)
                           and permissions.can_manage(user, r["owner_id"],
                                                      (r["drafter"] or {}).get("review_state")))
    mine = (submission_reads.of_owner(user, limit=10, state=Submission.CHECKING)
            if user.is_authenticated else [])
    return render(request, "leaderboard/queue.html", {
        "q": data, "hardware": hardware, "checking": submission_reads.checking_count(),
        "my_checking": mine})


# The largest id a database row can have (a 64-bit signed integer).
MAX_ID = 2 ** 63 - 1


@require_GET
def queue_progress(request):
    ids = [i for i in (_int(v, None) for v in request.GET.get("ids", "").split(",")[:200])
           if i is not None and 0 < i <= MAX_ID]
    return JsonResponse({"runs": run_reads.run_progress(
        ids, show_rejected=permissions.sees_rejected(request.user))})


@login_required
@require_POST
def run_cancel(request, run_id):
    run = run_reads.get_run(run_id)
    if run is None:
        raise Http404("no such run")
    if not permissions.can_manage_run(request.user, run):
        raise PermissionDenied("only the owner of the drafter or staff may cancel this run")
    state = submissions.cancel_run(run)
    messages.success(request, f"Run {run.pk}: " + (
        "cancelled." if state == Run.CANCELLED else
        "asked to stop; it stops after the cell it is measuring." if state == Run.RUNNING else
        f"already {state}."))
    return redirect(reverse("queue") + f"#run-{run.pk}")


@require_GET
def run_artifact(request, run_id):
    """The raw per-request records of a run (gzipped JSON lines), through the storage."""
    run = get_object_or_404(Run.objects.select_related("drafter"), pk=run_id)
    if not permissions.can_see_run(request.user, run):
        raise Http404("no such run")
    if not run.artifact:
        raise Http404("this run has no raw data yet")
    return FileResponse(run.artifact.open("rb"), as_attachment=True,
                        filename=f"specboard-run-{run.pk}-requests.jsonl.gz",
                        content_type="application/gzip")


# ---- compare ---------------------------------------------------------------------------

@require_GET
def compare(request):
    protocol = protocols.get_protocol(request.GET.get("protocol"))
    if protocol is None:
        raise Http404("no protocol with results")
    candidates = board.compare_candidates(protocol)
    slugs = list(dict.fromkeys(s for s in request.GET.getlist("d") if s))[:4]
    spec = protocol.spec
    temperature = _float(request.GET.get("temperature"), spec.temperatures)
    temperature = spec.temperatures[0] if temperature is None else temperature
    k = _int(request.GET.get("k"), spec.ks)
    task = request.GET.get("task") or None
    if task not in spec.task_names:
        task = None
    figs, summary, data, error = {}, [], None, None
    if len(slugs) == 1:
        error = "Choose at least two drafters."
    if len(slugs) >= 2:
        data = board.compare(protocol, slugs)
        if data["missing"]:
            error = ("No succeeded or measuring run under this protocol for: "
                     + ", ".join(data["missing"]))
        if len(data["entries"]) >= 1:
            figs, summary = charts.compare_charts(data, temperature, k, task)
    return render(request, "leaderboard/compare.html", {
        "protocol": shapes.protocol_summary(protocol), "candidates": candidates,
        "chosen": slugs, "figs": figs, "summary": summary, "error": error,
        "protocols": protocol_choices(),
        "protocol_ref": shapes.protocol_ref(protocol), "k": k, "task": task,
        "temperature": temperature, "has_charts": bool(figs),
        "measuring_entries": [e for e in (data or {}).get("entries", [])
                              if e["run"]["measuring"]],
    })


# ---- protocols -------------------------------------------------------------------------

@require_GET
def protocol_list(request):
    return render(request, "leaderboard/protocol_list.html",
                  {"protocols": protocols.protocol_list()})


@require_GET
def protocol_detail(request, slug, version):
    protocol = protocols.get_protocol(f"{slug}@{version}")
    if protocol is None:
        raise Http404("no such protocol")
    return render(request, "leaderboard/protocol_detail.html",
                  {"p": protocols.protocol_detail(protocol), "spec": protocol.spec,
                   "pays_definitions": analysis.definitions()})


@require_GET
def run_detail(request, run_id):
    """One run: state, engine, drift between its baseline passes, and every cell with its
    validity marks (self-checks), host load and the baseline cell its speedup divides by."""
    page = run_reads.run_page(run_id)
    if page is None or not permissions.can_see(
            request.user, (page["run"].get("drafter") or {}).get("review_state")):
        raise Http404("no such run")
    return render(request, "leaderboard/run.html", page)


@require_GET
def protocol_pays(request, slug, version):
    """When does it pay? The analyses of worker.analysis over the protocol's newest
    succeeded runs, and the recommender form (task weights w_<task>, batch_size)."""
    protocol = protocols.get_protocol(f"{slug}@{version}")
    if protocol is None:
        raise Http404("no such protocol")
    temps = protocol.spec.temperatures
    temperature = _float(request.GET.get("temperature"), temps)
    data = pays.protocol_pays(protocol, temperature, include_running=True)
    tasks = data["tasks"]
    weights, rec, rec_error = {}, None, None
    for t in tasks:
        raw = request.GET.get(f"w_{t}")
        weights[t] = raw if raw is not None else "1"
    b_param = _int(request.GET.get("batch_size"))
    if b_param is not None or any(f"w_{t}" in request.GET for t in tasks):
        try:
            mix = pays.parse_mix(",".join(f"{t}:{w}" for t, w in weights.items()
                                               if str(w).strip() != ""), tasks)
            if b_param is None or b_param < 1:
                raise ValueError("the batch size must be a whole number >= 1")
            rec = pays.recommendation(protocol, mix, b_param, data["temperature"])
        except ValueError as e:
            rec_error = str(e)
    figs = charts.pays_charts(data)
    return render(request, "leaderboard/pays.html", {
        "data": data, "p": data["protocol"], "figs": figs, "has_charts": bool(figs),
        "map_figs": [(key, f) for key, f in figs.items() if key.startswith("map_")],
        "operating_figs": [(key, f) for key, f in figs.items() if key.startswith("operating_")],
        "weights": [(t, weights[t]) for t in tasks], "batch_size": b_param,
        "rec": rec, "rec_error": rec_error, "temperatures": temps,
        "api_analysis": reverse("api:protocol_analysis", args=[slug, version]),
    })


# ---- engine upgrades ------------------------------------------------------------------------

@require_GET
def upgrades(request):
    """The pairs of engine versions a protocol family has drafters measured on."""
    return render(request, "leaderboard/upgrades.html",
                  {"pairs": history_reads.upgrade_pairs()})


@require_GET
def upgrade(request, slug, span):
    """Every drafter's change from one engine version to another (span "FROM...TO") under
    one protocol family (a protocol slug or a family hash), worst first."""
    from_version, sep, to_version = span.partition("...")
    if not sep or not from_version or not to_version:
        raise Http404("name the versions as FROM...TO")
    page = history_reads.upgrade(slug, from_version, to_version)
    if page is None:
        raise Http404("no such protocol")
    return render(request, "leaderboard/upgrade.html", {"u": page})


# ---- recipes --------------------------------------------------------------------------------

@require_GET
def recipes(request):
    """Every training recipe and its learning curve under one protocol (?protocol=slug@v,
    default: the newest protocol where recipe-trained drafters have results)."""
    ref = request.GET.get("protocol")
    protocol = recipe_reads.recipe_protocol(ref)
    if ref and protocol is None:
        raise Http404("no such protocol")
    temperature = None
    if protocol is not None:
        temperature = _float(request.GET.get("temperature"), protocol.spec.temperatures)
    page = recipe_reads.recipe_page(protocol, temperature)
    figs = charts.recipe_charts(page)
    return render(request, "leaderboard/recipes.html", {
        "page": page, "p": page["protocol"], "figs": figs, "has_charts": bool(figs),
        "task_figs": [(key, f) for key, f in figs.items() if key.startswith("al_task_")],
        "protocols": recipe_reads.recipe_protocols(),
    })


# ---- the live demo ------------------------------------------------------------------------

def demo_page(request):
    """Links to the Gradio app (`manage.py demo`, the demo/ package: a separate process in its
    own environment) and embeds it in an iframe."""
    return render(request, "leaderboard/demo.html", {"demo_url": settings.SPECBOARD_DEMO_URL})


# ---- accounts ----------------------------------------------------------------------------

def _rate(setting):
    """A django-ratelimit rate read from the settings when the request comes."""
    return lambda group, request: getattr(settings, setting)


def rate_limited(request, exception):
    """RATELIMIT_VIEW: a throttled sign-up, log-in or token creation."""
    return render(request, "429.html", status=429)


@ratelimit(key="ip", rate=_rate("SPECBOARD_SIGNUP_RATE"), method="POST")
def signup(request):
    if request.user.is_authenticated:
        return redirect("home")
    form = SignupForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = form.save()
        login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        messages.success(request, f"Welcome, {user.username}.")
        return redirect(safe_next(request) or "home")
    return render(request, "registration/signup.html", {"form": form})


def safe_next(request) -> str | None:
    """The ?next= address when it stays on this site (Django's own check, as its login view
    does), else None: never a redirect to another host or a javascript: URL."""
    target = request.POST.get("next") or request.GET.get("next")
    if target and url_has_allowed_host_and_scheme(
            target, allowed_hosts={request.get_host()}, require_https=request.is_secure()):
        return target
    return None


@login_required
@ratelimit(key="user", rate=_rate("SPECBOARD_TOKEN_RATE"), method="POST")
def account_settings(request):
    new_token = None
    form = TokenForm(request.POST or None)
    if request.method == "POST":
        if "revoke" in request.POST:
            if tokens.revoke_token(request.user, _int(request.POST["revoke"]) or 0):
                messages.success(request, "Token revoked.")
            return redirect("account_settings")
        if form.is_valid():
            _, new_token = tokens.create_token(request.user, form.cleaned_data["name"])
            form = TokenForm()
    response = render(request, "leaderboard/account_settings.html", {
        "form": form, "new_token": new_token, "tokens": accounts.user_tokens(request.user),
        "drafters": accounts.user_drafters(request.user),
    })
    response["Cache-Control"] = "no-store"  # a new token is shown once, never cached
    return response


# ---- errors ----------------------------------------------------------------------------

def server_error(request):
    """handler500: a database that does not answer (stopped, restarting, unreachable) is a
    503 with a short page that needs no database and no static files; anything else the
    plain 500 page. Django calls this inside its except block, so the error is at hand."""
    error = sys.exc_info()[1]
    if isinstance(error, (OperationalError, InterfaceError)):
        response = HttpResponse(loader.get_template("503.html").render(), status=503)
        response["Retry-After"] = "30"
        return response
    return HttpResponseServerError("<h1>Server error</h1><p>Something went wrong on our side; "
                                   "it has been logged.</p>")
