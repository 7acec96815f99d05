// Submit page: offer only the protocols of the chosen target, and show the n-gram
// parameters or the file input according to the method. Without JavaScript every field
// shows and the server checks the same rules.
(function () {
  "use strict";
  var target = document.getElementById("id_target");
  var protocol = document.getElementById("id_protocol");
  var method = document.getElementById("id_method");
  if (!target || !protocol || !method) { return; }

  function syncProtocols() {
    var first = null;
    Array.prototype.forEach.call(protocol.options, function (o) {
      var match = o.dataset.target === target.value;
      o.hidden = !match;
      o.disabled = !match;
      if (match && first === null) { first = o; }
    });
    var current = protocol.options[protocol.selectedIndex];
    if ((!current || current.disabled) && first) { protocol.value = first.value; }
  }

  function syncMethod() {
    var ngram = method.value === "ngram";
    ["prompt_lookup_min", "prompt_lookup_max"].forEach(function (name) {
      var field = document.getElementById("field-" + name);
      if (field) { field.hidden = !ngram; }
    });
    var files = document.getElementById("field-files");
    if (files) { files.hidden = ngram; }
  }

  target.addEventListener("change", syncProtocols);
  method.addEventListener("change", syncMethod);
  syncProtocols();
  syncMethod();
})();
