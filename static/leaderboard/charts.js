// Render every figure on the page: its JSON sits in <script type="application/json">
// next to an empty <div class="chart" data-figure="ID">; plotly.min.js is served locally.
(function () {
  "use strict";
  function render() {
    if (!window.Plotly) { return; }
    document.querySelectorAll("div.chart[data-figure]").forEach(function (div) {
      var source = document.getElementById(div.dataset.figure);
      if (!source) { return; }
      var fig = JSON.parse(source.textContent);
      window.Plotly.newPlot(div, fig.data || [], fig.layout || {},
        { responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] });
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", render);
  } else {
    render();
  }
})();
