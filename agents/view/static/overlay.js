// The token overlay of episode pages: colour each reply token by its behaviour log-prob (the
// default), by the advantage its turn was trained with, or by its replay-time IS ratio in one of
// the episode's replays (tokens carry data-logprob, data-adv and data-ratios). Each token's
// data-value holds the number its colour shows.
(function () {
  "use strict";
  var box = document.querySelector("[data-testid=overlay]");
  if (!box) return;
  var toks = document.querySelectorAll("[data-testid=reply-tokens] .tok");
  var key = box.querySelector("[data-testid=overlay-key]");
  var replay = box.querySelector("select[name=replay]");
  var clip = JSON.parse(box.dataset.clip || "[0.2, 0.2]");
  var maxAdv = 0;
  toks.forEach(function (t) { maxAdv = Math.max(maxAdv, Math.abs(parseFloat(t.dataset.adv) || 0)); });

  function ratioAt(t, k) {
    var parts = (t.dataset.ratios || "").split(",");
    var v = parts[k];
    return v === undefined || v === "" ? null : Math.exp(parseFloat(v));
  }
  function paint() {
    var mode = (box.querySelector("input[name=overlay]:checked") || {}).value || "logprob";
    var k = replay ? parseInt(replay.value, 10) : 0;
    toks.forEach(function (t) {
      var bg, value, label;
      if (mode === "adv") {
        value = parseFloat(t.dataset.adv) || 0;
        var a = maxAdv > 0 ? Math.min(1, Math.abs(value) / maxAdv) : 0;
        bg = "hsl(" + (value >= 0 ? 140 : 0) + ", 70%, " + (96 - 30 * a).toFixed(0) + "%)";
        label = "advantage " + value.toFixed(3);
      } else if (mode === "ratio") {
        value = ratioAt(t, k);
        if (value === null) {
          bg = "#e4e7ec"; label = "not in this update's loss";
        } else {
          var lr = Math.log(value), out = value < 1 - clip[0] || value > 1 + clip[1];
          var s = Math.min(1, Math.abs(lr) / Math.log(1 + Math.max(clip[0], clip[1])));
          bg = "hsl(" + (lr >= 0 ? 215 : 30) + ", " + (out ? 90 : 70) + "%, " + (96 - 34 * s).toFixed(0) + "%)";
          label = "IS ratio " + value.toFixed(4) + (out ? " (outside the clip range)" : "");
        }
      } else {
        value = parseFloat(t.dataset.logprob);
        bg = "hsl(" + (120 * Math.min(1, Math.max(0, Math.exp(value)))).toFixed(0) + ", 75%, 82%)";
        label = "log p " + value.toFixed(3);
      }
      t.style.background = bg;
      t.dataset.value = value === null ? "" : String(value);
      t.dataset.label = label;
    });
    key.textContent = mode === "adv" ? "green: positive advantage, red: negative (the stronger, the larger)"
      : mode === "ratio" ? "blue: pi/mu > 1, orange: < 1; saturated past the clip range [" + (1 - clip[0]) + ", " + (1 + clip[1]) + "]; grey: left out of the loss"
      : "";
  }
  box.addEventListener("change", paint);
  paint();
})();
