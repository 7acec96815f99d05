"""Every page's query parameters, fuzzed (issue #32, item 6): whatever a client puts in a
known parameter (superscript digits, NUL bytes, huge numbers, other scripts), a page
answers below 500. The API has its own generated-request test (tests/test_api.py)."""
import pytest
from django.test import Client
from django.urls import reverse
from hypothesis import HealthCheck, given, settings as hsettings
from hypothesis import strategies as st

from . import factories as f

pytestmark = pytest.mark.django_db

# The parameters each page reads (leaderboard/views.py, request.GET); "drafter" and
# "protocol_pays" are the pages of the board's first drafter and of its protocol.
PAGES = {
    "home": ("protocol", "target", "task", "temperature", "k", "method", "batch_size", "sort",
             "dir", "page"),
    "compare": ("protocol", "d", "temperature", "k", "task"),
    "recipes": ("protocol", "temperature"),
    "queue": ("hardware",),
    "queue_progress": ("ids",),
    "protocols": ("protocol",),
    "drafter": ("protocol", "k", "temperature"),
    "protocol_pays": ("temperature", "batch_size", "w_chat", "w_code"),
    "login": ("next",),
}
# Values that broke a page once, and the shapes a fuzzer reaches late.
NASTY = ["demo@²", "pages@²", "pages@1", "pages@99999999999999999999", "²", "٣", "1e309",
         "nan", "-1", "0", "\x00", "a\x00b", "x" * 5000, "pages@", "@", "../../etc/passwd"]


@pytest.fixture(autouse=True)
def no_page_cache(settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0


@pytest.fixture
def board():
    protocol = f.make_protocol(f.make_target())
    f.seed_board(protocol, 2)
    return protocol


def url_of(page, protocol):
    from leaderboard.models import Drafter

    if page == "drafter":
        return reverse(page, args=[Drafter.objects.order_by("pk").first().slug])
    if page == "protocol_pays":
        return reverse(page, args=[protocol.slug, protocol.version])
    return reverse(page)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_known_bad_values_never_make_a_page_fail(board, page):
    client = Client()
    for param in PAGES[page]:
        for value in NASTY:
            response = client.get(url_of(page, board), {param: value})
            assert response.status_code < 500, (page, param, value)


@pytest.mark.parametrize("page", sorted(PAGES))
@hsettings(max_examples=40, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_values_never_make_a_page_fail(board, page, data):
    params = {p: data.draw(st.text(max_size=40), label=p)
              for p in data.draw(st.lists(st.sampled_from(PAGES[page]), min_size=1,
                                          unique=True), label="params")}
    response = Client().get(url_of(page, board), params)
    assert response.status_code < 500, (page, params)


def test_a_nul_byte_in_a_page_address_is_a_400_before_any_query(board):
    client = Client()
    for url in ("/?protocol=pages%00", "/queue/?hardware=%00", "/compare/?d=a&d=%00b"):
        response = client.get(url)
        assert response.status_code == 400, url
        assert "NUL" in response.content.decode()


def test_only_valid_values_reach_the_page_cache(board, settings):
    """#32 item 5: 200 requests with made-up values add no cache entry beyond the page's
    own, and no made-up value reaches a link of the cached table."""
    from django.core.cache import cache

    settings.SPECBOARD_PAGE_CACHE_SECONDS = 300
    cache.clear()
    client = Client()
    from leaderboard.models import Drafter

    drafter = Drafter.objects.order_by("pk").first()
    pages = [reverse("home"), reverse("drafter", args=[drafter.slug])]

    def entries():
        return len(getattr(cache, "_cache", {}))

    for url in pages:
        client.get(url)
    baseline = entries()
    for i in range(200):
        for url in pages:
            made_up = f"zq{i}qz"
            html = client.get(url, {"dir": made_up, "sort": made_up, "page": 10 ** 9 + i,
                                    "k": made_up, "temperature": made_up, "task": made_up,
                                    "batch_size": made_up, "method": made_up}).content.decode()
            assert made_up not in html and str(10 ** 9 + i) not in html
    assert entries() == baseline, (baseline, entries())
