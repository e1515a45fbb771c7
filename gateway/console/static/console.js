// batchgate console: live regions and confirmations; no framework, no build step.
//
// An element with data-poll="<url>" is refreshed from that URL every 2 s (the server renders the
// fragment, escaped as every page is). Polling pauses while the tab is hidden, stops once the fragment
// says the job is final (data-final), and reloads the page when the session has ended (401), which
// then asks to sign in. A failed poll keeps the last view and marks it stale.
(function () {
  "use strict";
  var PERIOD_MS = 2000;

  function poll(region) {
    var url = region.getAttribute("data-poll");
    var busy = false;
    var timer = setInterval(function () {
      if (document.hidden || busy) { return; }
      busy = true;
      fetch(url, {credentials: "same-origin", headers: {"X-Console-Poll": "1"}, cache: "no-store"})
        .then(function (resp) {
          if (resp.status === 401) { clearInterval(timer); window.location.reload(); return null; }
          if (!resp.ok) { region.setAttribute("data-stale", "1"); return null; }
          return resp.text();
        })
        .then(function (html) {
          if (html === null) { return; }
          region.innerHTML = html;
          region.removeAttribute("data-stale");
          if (region.querySelector("[data-final]")) { clearInterval(timer); }
        })
        .catch(function () { region.setAttribute("data-stale", "1"); })
        .then(function () { busy = false; });
    }, PERIOD_MS);
    if (region.querySelector("[data-final]")) { clearInterval(timer); }
  }

  function confirmFirst(form) {
    form.addEventListener("submit", function (event) {
      if (!window.confirm(form.getAttribute("data-confirm"))) { event.preventDefault(); }
    });
  }

  document.querySelectorAll("[data-poll]").forEach(poll);
  document.querySelectorAll("form[data-confirm]").forEach(confirmFirst);
})();
