"""A drafter across engine versions: the comparison (worker.analysis.engine_history) on seeded
dicts, and its reads, pages and API on a seeded database (tests/factories.py: figures by
worker.metrics from chosen counts; records written with leaderboard.records.write_cell)."""
import pytest
from django.urls import reverse

from leaderboard import records
from leaderboard.models import Protocol, Result
from leaderboard.selectors import history
from worker import metrics
from worker.analysis import engine_history as eh

from . import factories as f

V_OLD, V_NEW = "0.31.0", "0.32.0"
HALF = 0.05            # intervals are value * (1 -/+ HALF)
TAU2 = 1e-4            # the protocols' between-run variance of the log-speedup
STEPS = [1, 3, 3, 3, 2]
PROMPTS = ("p0", "p1", "p2")


def with_intervals(cell: dict, half=HALF) -> dict:
    """The cell with AL and speedup intervals of relative half-width `half`."""
    out = dict(cell)
    for name in ("acceptance_length", "speedup"):
        out[f"{name}_low"], out[f"{name}_high"] = (out[name] * (1 - half),
                                                   out[name] * (1 + half))
    return out


def seeded_cell(temperature=0.0, speedup=1.5, quality=0.6, k=2):
    """A drafter cell with the factories' counts and figures, its intervals and records."""
    c = f.drafter_counts(quality, 0, 1, temperature, k)
    sc = metrics.SpecCounts(c["drafts"], c["draft_tokens"], c["accepted_tokens"],
                            c["accepted_at"])
    cell = {"task": "chat", "batch_size": 1, "temperature": temperature, "k": k,
            "repetitions": 1, **{n: c[n] for n in eh.COUNT_FIELDS},
            "acceptance_length": metrics.acceptance_length(sc),
            "engine_acceptance_length": metrics.acceptance_length(sc),
            "per_position_acceptance": metrics.per_position_acceptance(sc),
            "decode_tokens": c["generated_tokens"] - c["requests"],
            "decode_steps": c["drafts"], "speedup": speedup,
            # its protocol is calibrated between runs (speedups are judged)
            "speedup_between_run_variance": TAU2,
            "records": cell_records()}
    return with_intervals(cell)


def cell_records(changed: dict | None = None) -> list[dict]:
    """One record per prompt (repetition 0): outputs and tokens per engine step; `changed`
    gives some prompts other step_tokens (the same outputs)."""
    out = []
    for p in PROMPTS:
        steps = (changed or {}).get(p, STEPS)
        out.append({"prompt_id": p, "repetition": 0, "output_token_ids": list(range(sum(STEPS))),
                    "step_tokens": list(steps)})
    return out


def moved(cell: dict, name: str, factor: float) -> dict:
    """The cell with figure `name` scaled by `factor`, its interval with it."""
    out = dict(cell)
    for key in (name, f"{name}_low", f"{name}_high"):
        out[key] = cell[key] * factor
    return out


# ---- the comparison, pure -----------------------------------------------------------------

def test_engine_versions_are_ordered_as_versions():
    versions = ["0.10.0", "0.9.1", "0.9.0", "0.31.0"]
    assert sorted(versions, key=eh.version_key) == ["0.9.0", "0.9.1", "0.10.0", "0.31.0"]


@pytest.mark.parametrize("name", ["speedup", "acceptance_length"])
def test_a_change_outside_both_intervals_is_flagged_one_inside_is_not(name):
    old = seeded_cell(temperature=0.7)
    outside = eh.compare_cells(old, moved(old, name, 1 - 4 * HALF))
    assert outside["by_figure"][name]["verdict"] == eh.FLAGGED and outside["flagged"]
    assert any("outside both intervals" in flag for flag in outside["flags"])
    inside = eh.compare_cells(old, moved(old, name, 1 - HALF / 2))
    assert inside["by_figure"][name]["verdict"] == eh.WITHIN and not inside["flagged"]
    # the new value outside the old interval, the old one inside the wider new interval
    wide = moved(old, name, 1 - 1.5 * HALF)
    wide[f"{name}_low"], wide[f"{name}_high"] = wide[name] * 0.9, wide[name] * 1.1
    assert not old[f"{name}_low"] <= wide[name] <= old[f"{name}_high"]
    assert eh.compare_cells(old, wide)["by_figure"][name]["verdict"] == eh.WITHIN
    # no interval: not judged, not flagged
    bare = {**moved(old, name, 0.5), f"{name}_low": None}
    judged = eh.compare_cells(old, bare)
    assert judged["by_figure"][name]["verdict"] == eh.NOT_JUDGED and not judged["flagged"]


def test_a_speedup_is_judged_only_where_both_protocols_are_calibrated_between_runs():
    old = seeded_cell(temperature=0.7)
    far = moved(old, "speedup", 1 - 4 * HALF)
    assert eh.compare_cells(old, far)["by_figure"]["speedup"]["verdict"] == eh.FLAGGED
    for a, b in ((old, {**far, "speedup_between_run_variance": None}),
                 ({**old, "speedup_between_run_variance": None}, far)):
        judged = eh.compare_cells(a, b)
        figure = judged["by_figure"]["speedup"]
        assert figure["verdict"] == eh.NOT_JUDGED and figure["uncalibrated"]
        assert figure["reason"] == eh.NOT_CALIBRATED and not judged["flagged"]
        assert figure["relative"] == pytest.approx(-4 * HALF)     # the change is still shown
    # a calibrated variance of 0 (the estimate floored) is a calibration: judged
    zero = eh.compare_cells({**old, "speedup_between_run_variance": 0.0},
                            {**far, "speedup_between_run_variance": 0.0})
    assert zero["by_figure"]["speedup"]["verdict"] == eh.FLAGGED
    # acceptance length is not a between-run figure: judged either way
    bare = {**moved(old, "acceptance_length", 1 - 4 * HALF), "speedup_between_run_variance": None}
    assert eh.compare_cells(old, bare)["by_figure"]["acceptance_length"]["verdict"] == eh.FLAGGED


def test_greedy_counts_are_compared_exactly_and_per_pass():
    old = seeded_cell()
    assert not eh.compare_cells(old, dict(old))["flagged"]
    fewer = {**old, "accepted_tokens": old["accepted_tokens"] - 1,
             "accepted_at": [old["accepted_at"][0] - 1, *old["accepted_at"][1:]]}
    changed = eh.compare_cells(old, fewer)
    assert changed["flagged"] and changed["exact"]["counts_differ"] == ["accepted_tokens",
                                                                       "accepted_at"]
    assert any(flag.startswith("acceptance counts differ") for flag in changed["flags"])
    # twice the passes, twice the counts: the same per pass
    doubled = {**old, "repetitions": 2, **{n: old[n] * 2 for n in ("drafts", "draft_tokens",
                                                                   "accepted_tokens")},
               "accepted_at": [a * 2 for a in old["accepted_at"]]}
    assert eh.compare_cells(old, doubled)["exact"]["counts_differ"] == []


def test_differing_greedy_drafts_are_flagged_with_the_first_prompt_and_step():
    old = seeded_cell()
    other = [STEPS[0], STEPS[1] - 1, STEPS[2] + 1, *STEPS[3:]]
    new = {**old, "records": cell_records({"p1": other})}
    out = eh.compare_cells(old, new)
    assert out["exact"]["counts_differ"] == []          # the same counts
    assert out["exact"]["prompts_differ"] == 1
    assert out["exact"]["prompts_compared"] == len(PROMPTS)
    assert out["exact"]["first"] == {"prompt_id": "p1", "step": 1}
    assert f"drafts differ on 1 of {len(PROMPTS)} prompts" in " ".join(out["flags"])
    same = eh.compare_cells(old, {**old, "records": cell_records()})
    assert same["exact"]["records_compared"] and not same["flagged"]


def test_sampled_cells_are_never_compared_exactly():
    old = seeded_cell(temperature=0.7)
    new = {**old, "accepted_tokens": old["accepted_tokens"] + 3,
           "records": cell_records({"p0": [1, 11]})}
    out = eh.compare_cells(old, new)
    assert not out["exact"]["compared"] and out["exact"]["counts_differ"] == []
    assert out["exact"]["prompts_differ"] == 0 and not out["flagged"]


def test_the_summary_gives_flagged_cells_the_worst_speedup_and_the_al_change():
    greedy, sampled = seeded_cell(), seeded_cell(temperature=0.7, speedup=2.0)
    slower = moved(sampled, "speedup", 1 - 4 * HALF)
    out = eh.compare_versions([greedy, sampled], [greedy, slower])
    s = out["summary"]
    assert s["cells"] == 2 and s["flagged_cells"] == 1 and s["flagged"]
    assert s["worst_speedup_change"] == pytest.approx(slower["speedup"] / sampled["speedup"] - 1)
    assert s["worst_speedup_cell"]["temperature"] == sampled["temperature"]
    assert s["speedup_drop"] == pytest.approx(-s["worst_speedup_change"])
    assert s["acceptance_length_change"] == pytest.approx(0.0)
    assert eh.compare_versions([greedy], [greedy, sampled])["only_new"] == [
        eh.cell_key(sampled)]


# ---- a seeded database: reads, pages, API -----------------------------------------------

def write_records(run, temperature, recs):
    records.write_cell(run.pk, {"task": "chat", "batch_size": 1, "temperature": temperature,
                                "k": 2}, recs)


def add_intervals(run):
    for r in Result.objects.filter(run=run, k__gt=0):
        for name in ("acceptance_length", "speedup"):
            value = getattr(r, name)
            setattr(r, f"{name}_low", value * (1 - HALF))
            setattr(r, f"{name}_high", value * (1 + HALF))
        r.speedup_between_run_variance = TAU2
        r.save()


def scale_speedup(run, temperature, factor):
    r = Result.objects.get(run=run, temperature=temperature, k=2)
    r.speedup, r.speedup_low, r.speedup_high = (r.speedup * factor, r.speedup_low * factor,
                                                r.speedup_high * factor)
    r.save()
    return r


@pytest.fixture
def versions_db(db):
    """One protocol family on two engine versions (v1 unpinned, measured on V_OLD; v2 pinned
    to V_NEW) and four drafters: steady (the same), within (a speedup drop inside its
    intervals), slower (a drop outside both) and redrafted (the same counts, other greedy
    drafts on one prompt). Plus one drafter measured on V_OLD only."""
    target = f.make_target()
    p1 = f.make_protocol(target, slug="hist", tasks=("chat",), batch_sizes=(1,), ks=(2,),
                         temperatures=(0.0, 0.7))
    p2 = Protocol.objects.create(title=p1.title, target=target,
                                 spec=p1.spec.with_engine_version(V_NEW, 2).to_dict())
    drafters = {name: f.make_drafter(target, name) for name in
                ("steady", "within", "slower", "redrafted", "once")}
    runs = {}
    for protocol, version in ((p1, V_OLD), (p2, V_NEW)):
        base = f.add_baseline_results(f.make_run(protocol, engine_version=version))
        for name, d in drafters.items():
            if name == "once" and version == V_NEW:
                continue
            run = f.make_run(protocol, d, engine_version=version)
            f.add_drafter_results(run, 0.6, base)
            add_intervals(run)
            changed = {"p1": [1, 2, 4, 3, 2]} if name == "redrafted" and version == V_NEW else None
            write_records(run, 0.0, cell_records(changed))
            # sampled cells' drafts differ on every version: never compared exactly
            write_records(run, 0.7, cell_records({"p0": [1, 11]} if version == V_NEW else None))
            runs[(name, version)] = run
    scale_speedup(runs[("within", V_NEW)], 0.7, 1 - HALF / 2)
    scale_speedup(runs[("slower", V_NEW)], 0.7, 1 - 4 * HALF)
    return {"p1": p1, "p2": p2, "drafters": drafters, "runs": runs}


def test_one_family_holds_both_protocol_versions(versions_db):
    assert history.family_of(versions_db["p1"]) == history.family_of(versions_db["p2"])
    assert versions_db["p1"].sha256 != versions_db["p2"].sha256


def test_drafter_history_has_both_versions_and_flags_what_moved(versions_db):
    runs = versions_db["runs"]
    h = history.drafter_history("slower")
    assert h["multi_version"] and len(h["families"]) == 1
    family = h["families"][0]
    assert [v["engine_version"] for v in family["versions"]] == [V_OLD, V_NEW]
    assert [v["run_id"] for v in family["versions"]] == [runs[("slower", V_OLD)].pk,
                                                         runs[("slower", V_NEW)].pk]
    assert family["ref"] == "hist"
    (comp,) = family["comparisons"]
    flagged = [c for c in comp["cells"] if c["flagged"]]
    assert [(c["temperature"], c["by_figure"]["speedup"]["verdict"]) for c in flagged] == [
        (0.7, eh.FLAGGED)]
    row = next(r for r in family["rows"] if r["temperature"] == 0.7)
    new_speedup = Result.objects.get(run=runs[("slower", V_NEW)], temperature=0.7).speedup
    assert row["versions"][1]["cell"]["speedup"] == pytest.approx(new_speedup)
    assert row["versions"][0]["change"] is None and row["versions"][1]["change"]["flagged"]

    steady = history.drafter_history("steady")["families"][0]["comparisons"][0]
    assert steady["summary"]["flagged_cells"] == 0
    greedy = next(c for c in steady["cells"] if c["temperature"] == 0)
    assert greedy["exact"]["records_compared"] and greedy["exact"]["prompts_differ"] == 0
    sampled = next(c for c in steady["cells"] if c["temperature"] > 0)
    assert not sampled["exact"]["compared"]

    redrafted = history.drafter_history("redrafted")["families"][0]["comparisons"][0]
    (cell,) = [c for c in redrafted["cells"] if c["flagged"]]
    assert cell["temperature"] == 0 and cell["exact"]["first"] == {"prompt_id": "p1", "step": 1}
    assert cell["exact"]["counts_differ"] == []

    once = history.drafter_history("once")
    assert not once["multi_version"]
    assert [v["engine_version"] for v in once["families"][0]["versions"]] == [V_OLD]


def test_upgrade_lists_every_drafter_worst_first(versions_db):
    u = history.upgrade("hist", V_OLD, V_NEW)
    names = [d["drafter"]["slug"] for d in u["drafters"]]
    assert names == ["slower", "redrafted", "within", "steady"]
    assert u["flagged_drafters"] == 2
    flags = [d["summary"]["flagged"] for d in u["drafters"]]
    assert flags == sorted(flags, reverse=True)
    drops = [d["summary"]["speedup_drop"] for d in u["drafters"] if not d["summary"]["flagged"]]
    assert drops == sorted(drops, reverse=True) and drops[0] > 0
    assert history.upgrade(u["family"], V_OLD, V_NEW)["drafters"] == u["drafters"]
    assert history.upgrade("nothing-here", V_OLD, V_NEW) is None
    assert history.upgrade("hist", V_NEW, "9.9.9")["drafters"] == []
    pairs = history.upgrade_pairs()
    assert [(p["ref"], p["from"], p["to"], p["drafters"]) for p in pairs] == [
        ("hist", V_OLD, V_NEW, len(u["drafters"]))]


def test_the_drafter_page_and_the_upgrade_pages_show_flags_and_figures(client, versions_db):
    runs = versions_db["runs"]
    page = client.get(reverse("drafter", args=["slower"])).content.decode()
    assert "Across engine versions" in page
    assert "changed outside both intervals" in page
    new_speedup = Result.objects.get(run=runs[("slower", V_NEW)], temperature=0.7).speedup
    assert f"{new_speedup:.2f}" in page
    assert reverse("upgrade", args=["hist", f"{V_OLD}...{V_NEW}"]) in page
    once = client.get(reverse("drafter", args=["once"])).content.decode()
    assert f"Measured on engine version {V_OLD} only" in once
    assert "changed outside both intervals" not in once

    listing = client.get(reverse("upgrades")).content.decode()
    assert reverse("upgrade", args=["hist", f"{V_OLD}...{V_NEW}"]) in listing
    upgrade = client.get(reverse("upgrade", args=["hist", f"{V_OLD}...{V_NEW}"]))
    assert upgrade.status_code == 200
    html = upgrade.content.decode()
    order = [html.index(reverse("drafter", args=[name])) for name in
             ("slower", "redrafted", "within", "steady")]
    assert order == sorted(order)
    assert f"drafts differ on 1 of {len(PROMPTS)} prompts" in html
    drop = new_speedup / Result.objects.get(run=runs[("slower", V_OLD)], temperature=0.7).speedup
    assert f"{(drop - 1) * 100:.1f}%" in html
    assert client.get(reverse("upgrade", args=["hist", V_OLD])).status_code == 404
    assert client.get(reverse("upgrade", args=["nope", f"{V_OLD}...{V_NEW}"])).status_code == 404
    # the new version not calibrated between runs: the drop is shown, not judged
    Result.objects.filter(run=runs[("slower", V_NEW)]).update(speedup_between_run_variance=None)
    page = client.get(reverse("drafter", args=["slower"])).content.decode()
    assert "not judged: not calibrated" in page and f"{new_speedup:.2f}" in page
    assert "changed outside both intervals" not in page


def test_the_api_gives_the_history_and_the_upgrades(client, versions_db):
    h = client.get("/api/drafters/redrafted/history")
    assert h.status_code == 200
    family = h.json()["families"][0]
    assert [v["engine_version"] for v in family["versions"]] == [V_OLD, V_NEW]
    comp = family["comparisons"][0]
    assert (comp["from_version"], comp["to_version"]) == (V_OLD, V_NEW)
    assert comp["summary"]["flagged_cells"] == 1
    assert client.get("/api/drafters/nobody/history").status_code == 404
    pairs = client.get("/api/upgrades").json()
    assert [(p["ref"], p["from_version"], p["to_version"]) for p in pairs] == [
        ("hist", V_OLD, V_NEW)]
    u = client.get(f"/api/upgrades/hist/{V_OLD}/{V_NEW}").json()
    assert [d["drafter"]["slug"] for d in u["drafters"]][:2] == ["slower", "redrafted"]
    assert u["drafters"][1]["flags"][0]["flag"].startswith("drafts differ")
    assert client.get(f"/api/upgrades/nope/{V_OLD}/{V_NEW}").status_code == 404
