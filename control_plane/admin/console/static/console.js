// The console's only script (served from /console/static: the pages' Content-Security-Policy
// forbids inline scripts). The Fleet page's table body follows the log through server-sent events.
"use strict";
(function () {
  var body = document.getElementById("fleet-rows");
  var live = document.getElementById("live");
  if (!body || !body.dataset.stream || !window.EventSource) { return; }
  var es = new EventSource(body.dataset.stream);
  es.addEventListener("open", function () { live.textContent = "Live updates: on."; });
  es.addEventListener("fleet", function (e) {
    body.innerHTML = e.data;
    live.textContent = "Live updates: on, last at " + new Date().toLocaleTimeString() + ".";
  });
  es.addEventListener("error", function () { live.textContent = "Live updates: reconnecting…"; });
})();
