// Queue page: poll the progress endpoint every 2 s and update each active run's state,
// position, progress bar and ETA without reloading the page.
(function () {
  "use strict";
  var table = document.getElementById("active-runs");
  if (!table) { return; }
  var url = table.dataset.progressUrl;
  var ACTIVE = { queued: true, running: true };

  function duration(s) {
    if (s === null || s === undefined) { return "\u2014"; }
    s = Math.round(s);
    if (s >= 3600) { return Math.floor(s / 3600) + "h " + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m"; }
    if (s >= 60) { return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s"; }
    return s + "s";
  }

  function activeIds() {
    return Array.prototype.map.call(table.querySelectorAll("tr[data-run-id]"), function (tr) {
      return tr.dataset.runId;
    }).filter(function (id) {
      var tr = document.getElementById("run-" + id);
      return tr && ACTIVE[tr.dataset.state];
    });
  }

  function update(run) {
    var tr = document.getElementById("run-" + run.id);
    if (!tr) { return; }
    tr.dataset.state = run.state;
    var state = tr.querySelector("[data-field=state]");
    state.textContent = run.state;
    state.className = "state " + run.state;
    tr.querySelector("[data-field=position]").textContent = run.position ? run.position : "\u2014";
    var bar = tr.querySelector(".bar");
    bar.setAttribute("aria-valuenow", run.cells_done);
    bar.querySelector("span").style.width = (Math.max(0, Math.min(1, run.progress)) * 100).toFixed(1) + "%";
    var text = run.cells_done + "/" + run.cells_total + " cells";
    if (run.state === "running") { text += " \u00b7 ETA " + duration(run.eta_seconds); }
    if (!ACTIVE[run.state]) { text += " \u00b7 " + run.state + (run.error ? ": " + run.error : ""); }
    tr.querySelector("[data-field=progress]").textContent = text;
  }

  function poll() {
    var ids = activeIds();
    if (!ids.length) { return; }
    fetch(url + "?ids=" + ids.join(","), { headers: { "Accept": "application/json" }, cache: "no-store" })
      .then(function (r) { return r.ok ? r.json() : { runs: [] }; })
      .then(function (data) { data.runs.forEach(update); })
      .catch(function () { /* try again on the next tick */ })
      .finally(function () { window.setTimeout(poll, 2000); });
  }
  window.setTimeout(poll, 2000);
})();
