"""The recipe page (/recipes/): every training recipe and its learning curve under one
protocol, from the drafters trained by a recipe (here, with a TrainingDataset row, or
shipped, with the figures recorded with them), each at its shown run (succeeded, else still
measuring). The figures are checked against the cells' counts by the metric definitions
(worker.metrics), not against the page's own helpers."""
import html as html_lib
import json
import re

import pytest
from django.urls import reverse

from leaderboard.models import Result, Run
from worker import metrics
from worker.training.recipes import RECIPES

from .factories import (add_baseline_results, add_drafter_results, make_drafter, make_protocol,
                        make_run, make_target)
from .factories import make_trained_drafter as trained
from .factories import make_training_dataset as dataset


@pytest.fixture
def curves(db):
    target = make_target()
    protocol = make_protocol(target, slug="curves", batch_sizes=(1, 8), ks=(2, 4))
    baseline = make_run(protocol)
    base = add_baseline_results(baseline)
    small = dataset(target, "demo-chat-128", 128, 20000, 700.0)
    large = dataset(target, "demo-chat-1k", 1024, 160000, 2900.0)
    out = {"protocol": protocol, "target": target}
    for key, name, recipe, method, data, quality, seconds, details in (
            ("eagle_small", "eagle 128", "eagle", "eagle", small, 0.35, 600.0, None),
            ("eagle_large", "eagle 1k", "eagle", "eagle", large, 0.55, 4000.0,
             {"steps": 600, "final_top1": 0.8123}),
            ("medusa_small", "medusa <b>128</b>", "medusa_reduced_vocab", "medusa", small, 0.3,
             300.0, {"steps": 600, "final_top1": 0.7, "settings": {"heldout": 16},
                     "heldout_top1": 0.3456, "train_sample_top1": 0.6789})):
        d = trained(target, name, recipe, method, data, seconds, details)
        add_drafter_results(make_run(protocol, d), quality, base)
        out[key] = d
    # Shipped: no dataset row here, its figures recorded with it; its run still measuring.
    shipped = trained(target, "medusa shipped 4k", "medusa_reduced_vocab", "medusa", None, 2500.0,
                      details={"steps": 600, "data_slug": "demo-chat-4k", "data_version": 1,
                               "data_conversations": 4096, "data_answer_tokens": 640000,
                               "data_seconds": 11000.0, "shipped": "medusa-4k"})
    run = make_run(protocol, shipped, state=Run.RUNNING)
    add_drafter_results(run, 0.45, base)
    Result.objects.filter(run=run, task="code").delete()   # measured chat only so far
    run.cells_done = Result.objects.filter(run=run).count()
    run.save()
    out["shipped"], out["shipped_run"] = shipped, run
    # Not measured under this protocol; an n-gram drafter (not trained) is not on the page.
    out["unmeasured"] = trained(target, "eagle never run", "eagle", "eagle", small, 50.0)
    make_drafter(target, "plain ngram")
    return out


def expected_al(drafter, protocol, task, k=4):
    rows = Result.objects.filter(run__drafter=drafter, run__protocol=protocol, task=task, k=k)
    counts = metrics.SpecCounts(sum(r.drafts for r in rows), sum(r.draft_tokens for r in rows),
                                sum(r.accepted_tokens for r in rows))
    return metrics.acceptance_length(counts)


def row_cells(html, drafter_name):
    """The table cells of the rows of one drafter (its first row holds the shared columns)."""
    table = html.split('id="recipe-table"')[1].split("</table>")[0]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)
    start = next(i for i, r in enumerate(rows) if drafter_name in r)
    n = len(re.findall(r"<td", rows[start])) and int(re.search(r'rowspan="(\d+)"', rows[start]).group(1))
    return [[html_lib.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in rows[start:start + n]]


@pytest.mark.django_db
def test_recipe_page_lists_every_recipe_and_each_drafters_figures(client, curves):
    protocol = curves["protocol"]
    # Decode steps as a worker records them (steps that drafted nothing included).
    for r in Result.objects.filter(run__drafter=curves["eagle_large"]):
        r.decode_tokens, r.decode_steps = r.generated_tokens, r.drafts + 7 * r.batch_size
        r.save(update_fields=["decode_tokens", "decode_steps"])
    response = client.get(reverse("recipes"))
    assert response.status_code == 200
    html = response.content.decode()
    assert f"curves v1" in html   # the newest protocol where recipe drafters have results
    for name, cls in RECIPES.items():
        assert f'id="recipe-{name}"' in html and cls.summary.replace("'", "&#x27;") in html
    # eagle 1k: chat and code rows, AL at the largest k pooled over batch sizes, speedups
    # at b = 1 and 8: one cell each, so exactly the stored figure.
    # Its top-1 on the training data (recorded by the training) beside the measured
    # position-1 acceptance of each task.
    rows = row_cells(html, "eagle 1k")
    assert rows[0][:7] == ["eagle", "eagle 1k", "1024", "160000", "48m 20s", "1h 06m", "0.81"]
    for cells, task in ((rows[0][7:], "chat"), (rows[1], "code")):
        assert cells[0] == task
        assert cells[1].startswith(f"{expected_al(curves['eagle_large'], protocol, task):.2f}")
        mine = Result.objects.filter(run__drafter=curves["eagle_large"], task=task, k=4)
        assert cells[2] == f"{metrics.tokens_per_step(sum(r.decode_tokens for r in mine), sum(r.decode_steps for r in mine)):.2f}"
        drafts = sum(r.drafts for r in mine)
        first_accepted = sum(r.accepted_at[0] for r in mine)
        assert 0 < first_accepted < drafts
        assert cells[3] == f"{first_accepted / drafts:.2f}"
        for b, text in ((1, cells[4]), (8, cells[5])):
            stored = Result.objects.get(run__drafter=curves["eagle_large"], task=task,
                                        batch_size=b, k=4).speedup
            assert text == f"{stored:.2f}×"
    # The shipped drafter: its recorded data figures, its run marked measuring, code not
    # measured yet.
    # Trained with conversations held out: top-1 on as many training ones / on those.
    assert row_cells(html, "medusa &lt;b&gt;128")[0][6] == "0.68 / 0.35"
    rows = row_cells(html, "medusa shipped 4k")
    assert rows[0][2:7] == ["4096", "640000", "3h 03m", "41m 40s", "—"]
    run = curves["shipped_run"]
    assert f"measuring: {run.cells_done} of {run.cells_total} cells" in rows[0][1]
    assert rows[1][0] == "code" and rows[1][1:] == ["—", "—", "—", "—", "—"]
    assert "eagle never run" in html.split('id="unmeasured"')[1]
    assert "plain ngram" not in html
    # The table gives both figures of the definitions: AL and tokens per step.
    assert "Tokens / step" in html and "Position-1 acceptance" in html and "Speedup b=1" in html and "Speedup b=8" in html


@pytest.mark.django_db
def test_learning_curves_plot_one_line_per_recipe_against_data_and_time(client, curves):
    html = client.get(reverse("recipes"), {"protocol": "curves@1"}).content.decode()
    figs = {m.group(1): json.loads(m.group(2)) for m in re.finditer(
        r'<script type="application/json" id="fig-([^"]+)">(.*?)</script>', html, re.S)}
    assert set(figs) == {"al_task_0", "al_task_1", "al_time"}
    chat = figs["al_task_0"]
    assert chat["layout"]["xaxis"]["type"] == "log"
    lines = {t["name"]: t for t in chat["data"]}
    assert set(lines) == {"eagle", "medusa_reduced_vocab"}
    assert lines["eagle"]["x"] == [128, 1024]
    assert lines["eagle"]["y"] == pytest.approx(
        [expected_al(curves[k], curves["protocol"], "chat") for k in ("eagle_small", "eagle_large")])
    # medusa: the 128-conversation drafter and the shipped 4k one (measuring: open marker);
    # names from the data are escaped for plotly.
    medusa = lines["medusa_reduced_vocab"]
    assert medusa["x"] == [128, 4096]
    assert medusa["marker"]["symbol"] == ["circle", "circle-open"]
    assert medusa["text"][0] == "medusa &lt;b&gt;128&lt;/b&gt;"
    code = {t["name"]: t for t in figs["al_task_1"]["data"]}
    assert code["medusa_reduced_vocab"]["x"] == [128]   # the shipped run has no code cell yet
    time = {t["name"]: t for t in figs["al_time"]["data"]}
    assert time["eagle"]["x"] == [600.0, 4000.0]
    assert figs["al_time"]["layout"]["xaxis"]["type"] == "log"
    # The recipes' slope per doubling of the data, over all tasks (eagle: two data sizes).
    al = [expected_al_all(curves[k], curves["protocol"]) for k in ("eagle_small", "eagle_large")]
    slope = (al[1] - al[0]) / 3   # 128 -> 1024 is three doublings
    assert re.search(rf'id="recipe-eagle">.*?<td class="num">{slope:.3f}</td></tr>', html, re.S)
    assert 'id="how-to-read"' in html


def expected_al_all(drafter, protocol, k=4):
    rows = Result.objects.filter(run__drafter=drafter, run__protocol=protocol, k=k)
    return metrics.acceptance_length(metrics.SpecCounts(
        sum(r.drafts for r in rows), sum(r.draft_tokens for r in rows),
        sum(r.accepted_tokens for r in rows)))


@pytest.mark.django_db
def test_recipe_page_protocol_choice_nav_and_links(client, curves):
    target = curves["target"]
    # A newer protocol without recipe results does not become the page's default.
    newer = make_protocol(target, slug="newer")
    make_run(newer, curves["eagle_large"], state=Run.QUEUED)
    html = client.get(reverse("recipes")).content.decode()
    assert "curves v1" in html
    assert client.get(reverse("recipes"), {"protocol": "newer@1"}).status_code == 200
    assert client.get(reverse("recipes"), {"protocol": "nope@1"}).status_code == 404
    assert client.get(reverse("recipes"), {"protocol": "curves@x"}).status_code == 404
    # Linked from every page's navigation and from a trained drafter's page.
    assert f'href="{reverse("recipes")}"' in client.get(reverse("home")).content.decode()
    page = client.get(reverse("drafter", args=[curves["eagle_large"].slug])).content.decode()
    assert f'{reverse("recipes")}?protocol=curves@1#recipe-eagle' in page


@pytest.mark.django_db
def test_recipe_page_without_any_trained_drafter_lists_the_recipes(client):
    response = client.get(reverse("recipes"))
    assert response.status_code == 200
    html = response.content.decode()
    assert all(f'id="recipe-{name}"' in html for name in RECIPES)
    assert "fig-al_time" not in html


@pytest.mark.django_db
def test_recipe_page_reads_in_a_bounded_number_of_queries(client, curves, django_assert_max_num_queries):
    for i in range(6):   # more drafters: the same number of queries
        d = trained(curves["target"], f"extra eagle {i}", "eagle", "eagle",
                    dataset(curves["target"], f"extra-{i}", 64 * (i + 1), 1000, 10.0))
        base = list(Result.objects.filter(run__drafter__isnull=True))
        add_drafter_results(make_run(curves["protocol"], d), 0.4, base)
    with django_assert_max_num_queries(12):
        assert client.get(reverse("recipes")).status_code == 200
