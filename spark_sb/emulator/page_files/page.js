// The emulator's live page (spark_sb/emulator/page.py renders it): polls the namespaces' part every second, peeks
// messages, sets and heals faults. Every request is same-origin and sends the header the emulator's controls need
// (X-Spark-SB-Emulator: 1); what it inserts is HTML the emulator rendered and escaped.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const poll = Number(document.body.dataset.pollMs) || 1000;
  // every request is bounded: an emulator that accepts and never answers shows as unreachable, the poll goes on
  const wait = Number(document.body.dataset.timeoutMs) || 10000;
  let last = "";
  let failing = false;

  function headers(json) {
    const h = { "X-Spark-SB-Emulator": "1" };
    if (json) h["Content-Type"] = "application/json";
    const key = $("key") ? $("key").value.trim() : "";
    if (key.startsWith("SharedAccessSignature ")) h["Authorization"] = key;
    else if (key) h["X-Spark-SB-Key"] = key;
    return h;
  }

  async function text(response) {
    const body = await response.text();
    if (response.ok) return body;
    let detail = body;
    try { detail = JSON.parse(body).error || body; } catch (e) { /* not JSON: the text as it is */ }
    throw new Error(`${response.status}: ${detail}`);
  }

  async function refresh() {
    if (document.hidden) {  // a tab in the background asks nothing; it catches up when shown
      setTimeout(refresh, poll);
      return;
    }
    try {
      const html = await text(await fetch("/$page/namespaces", { headers: headers(false), cache: "no-store",
                                                                 signal: AbortSignal.timeout(wait) }));
      if (html !== last) {
        $("namespaces").innerHTML = html;
        last = html;
      }
      $("updated").textContent = `live: updated ${new Date().toLocaleTimeString()}`;
      $("updated").classList.remove("stale");
      $("namespaces").classList.remove("stale");
      failing = false;
    } catch (err) {
      if (!failing) $("updated").textContent = `cannot reach the emulator (${err.message}): retrying every second`;
      $("updated").classList.add("stale");
      $("namespaces").classList.add("stale");  // the last counts stay, dimmed: they are no longer live
      failing = true;
    } finally {
      setTimeout(refresh, poll);
    }
  }

  async function peek(params) {
    const query = new URLSearchParams(params);
    try {
      $("messages").innerHTML = await text(await fetch(`/$page/messages?${query}`, { headers: headers(false),
                                                                                    signal: AbortSignal.timeout(wait) }));
    } catch (err) {
      $("messages").innerHTML = "";
      const p = document.createElement("p");
      p.className = "error";
      p.textContent = `peek refused: ${err.message}`;
      $("messages").append(p);
    }
  }

  async function post(op, body) {
    const result = $("fault-result");
    try {
      const answer = JSON.parse(await text(await fetch(`/$page/${op}`, {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal: AbortSignal.timeout(wait),
      })));
      result.textContent = answer.message;
      result.className = "ok";
    } catch (err) {
      result.textContent = `${op} refused: ${err.message}`;
      result.className = "error";
    }
    last = "";
  }

  function formFields() {
    const duration = $("fault-duration").value.trim();
    return {
      namespace: $("fault-namespace").value,
      entity: $("fault-entity").value.trim() || null,
      kind: $("fault-kind").value,
      duration: duration ? Number(duration) : null,
    };
  }

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (!button) return;
    const d = button.dataset;
    if (d.action === "heal") post("heal", { namespace: d.namespace, entity: d.entity || null });
    else if (d.action === "peek") peek({ namespace: d.namespace, entity: d.entity });
    else if (d.action === "dlq") peek({ namespace: d.namespace, entity: d.entity, dlq: "1" });
    else if (d.action === "page") {
      const params = { namespace: d.namespace, entity: d.entity, dlq: d.dlq };
      if (d.before) params.before = d.before;
      if (d.start) params.from = d.start;
      peek(params);
    } else if (d.action === "from") {
      peek({ namespace: d.namespace, entity: d.entity, dlq: d.dlq, from: $("from-seq").value || "0" });
    }
  });
  $("fault-form").addEventListener("submit", (event) => {
    event.preventDefault();
    post("fault", formFields());
  });
  $("heal-fault").addEventListener("click", () => {
    const f = formFields();
    post("heal", { namespace: f.namespace, entity: f.entity });
  });
  refresh();
})();
