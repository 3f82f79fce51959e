// labkit deck navigation (no dependencies): arrows / PageUp / PageDown / space / Home / End,
// URL hash #/N (1-based), ?all shows every slide stacked. On load it records a self-check on
// <body>: data-broken-images (images that failed to decode), data-overflow (slides whose content
// does not fit 1280 x 720), data-checked="yes" -- tests read them with chromium --dump-dom.
(function () {
  var slides = Array.prototype.slice.call(document.querySelectorAll("section.slide"));
  var all = /(^|[?&])all\b/.test(location.search);
  var deck = document.querySelector(".deck");
  var current = 0;
  if (all) document.documentElement.classList.add("all");
  function fit() {
    if (all) return;
    var s = Math.min(window.innerWidth / 1280, window.innerHeight / 720);
    deck.style.transform = "translate(-50%, -50%) scale(" + s + ")";
  }
  function show(i) {
    current = Math.max(0, Math.min(slides.length - 1, i));
    slides.forEach(function (el, k) { el.classList.toggle("current", k === current); });
    if (!all && location.hash !== "#/" + (current + 1)) history.replaceState(null, "", "#/" + (current + 1));
  }
  function fromHash() {
    var m = /^#\/(\d+)$/.exec(location.hash);
    show(m ? parseInt(m[1], 10) - 1 : 0);
  }
  document.addEventListener("keydown", function (e) {
    var next = { ArrowRight: 1, ArrowDown: 1, PageDown: 1, " ": 1, n: 1, ArrowLeft: -1, ArrowUp: -1, PageUp: -1, p: -1 };
    if (e.key in next) { show(current + next[e.key]); e.preventDefault(); }
    else if (e.key === "Home") show(0);
    else if (e.key === "End") show(slides.length - 1);
  });
  document.addEventListener("click", function (e) { if (!all && !e.target.closest("a")) show(current + 1); });
  window.addEventListener("resize", fit);
  window.addEventListener("hashchange", fromHash);
  window.addEventListener("load", function () {
    var broken = Array.prototype.filter.call(document.images, function (im) { return !im.complete || im.naturalWidth === 0; });
    var over = slides.filter(function (el) { return el.scrollHeight > el.clientHeight + 2 || el.scrollWidth > el.clientWidth + 2; });
    document.body.dataset.brokenImages = String(broken.length);
    document.body.dataset.overflow = over.map(function (el) { return el.dataset.n; }).join(",");
    document.body.dataset.checked = "yes";
  });
  fit();
  fromHash();
})();
