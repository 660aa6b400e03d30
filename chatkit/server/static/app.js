// chatkit's chat page: plain JavaScript over the server's own APIs, also an example of using them.
//   POST v1/responses (stream, store, previous_response_id)  a turn, streamed as server-sent events
//   GET  v1/responses/{id}                                    a stored response (after Stop)
//   GET  v1/conversations?after=, v1/conversations/{id}       the stored conversations (paged), a chain's turns
// A conversation here is a list of turns, one per stored response: {input: [items], response}. The
// last turn's response id is the head that the next request chains on; regenerate and edit resend a
// turn's input from the turn before it (a branch), undo drops the last exchange. Model text only ever
// goes into the page through textContent.
"use strict";

const API = "v1";
const $ = (id) => document.getElementById(id);
const CALCULATE = {
  type: "function", name: "calculate",
  description: "Evaluate an arithmetic expression exactly, with + - * / and parentheses.",
  parameters: {
    type: "object", required: ["expression"],
    properties: { expression: { type: "string", description: 'The arithmetic to do, e.g. "12 * (3 + 4)".' } },
  },
};

const state = { turns: [], busy: false, controller: null, gap: false };

// -- talking to the server ------------------------------------------------------------------------
function headers() {
  const key = localStorage.getItem("chatkit.apiKey");
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function api(path, options = {}) {
  const response = await fetch(`${API}/${path}`, { headers: headers(), ...options });
  if (response.status === 401) $("key-form").hidden = false;
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    const error = new Error(body.error?.message || `${response.status} ${response.statusText}`);
    error.status = response.status;
    throw error;
  }
  return response;
}

// Server-sent events from a fetch() body: yields each event's parsed data.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield JSON.parse(data);
    }
  }
}

// -- the conversation list ------------------------------------------------------------------------
// The list comes a page at a time (newest first); the next page when the sidebar is scrolled near its end.
const listing = { after: null, more: false, loading: false };

async function loadConversations(more = false) {
  if (more && (!listing.more || listing.loading)) return;
  listing.loading = true;
  let list;
  try {
    const query = more ? `?after=${encodeURIComponent(listing.after)}` : "";
    list = await (await api(`conversations${query}`)).json();
  } catch (error) {
    return showError(error);
  } finally {
    listing.loading = false;
  }
  listing.after = list.last_id ?? listing.after;
  listing.more = Boolean(list.has_more);
  const items = list.data.map((c) => {
    const li = element("li", c.id === state.turns[0]?.response?.id ? "current" : "");
    const when = new Date(c.updated_at * 1000).toLocaleString();
    li.append(element("span", "title", c.title || "(untitled)"),
              element("span", "meta", `${c.turns} turn${c.turns === 1 ? "" : "s"} · ${when}`));
    li.addEventListener("click", () => openConversation(c.head));
    return li;
  });
  if (more) $("conversations").append(...items);
  else $("conversations").replaceChildren(...items);
  const sidebar = $("sidebar");
  if (listing.more && sidebar.scrollHeight <= sidebar.clientHeight + 40) loadConversations(true);  // not full yet
}

function onSidebarScroll() {
  const sidebar = $("sidebar");
  if (sidebar.scrollTop + sidebar.clientHeight >= sidebar.scrollHeight - 40) loadConversations(true);
}

async function openConversation(head, quiet = false) {
  if (state.busy) return;
  try {
    const chain = await (await api(`conversations/${encodeURIComponent(head)}`)).json();
    state.turns = chain.data;
    state.gap = Boolean(chain.gap);  // earlier responses of the conversation were deleted
    render();
    showStats(state.turns.at(-1)?.response?.usage, null);
    loadConversations();
  } catch (error) {
    if (!quiet) showError(error);
  }
  setHead();
}

function currentHead() {
  return state.turns.at(-1)?.response?.id ?? null;
}

function setHead() {
  const head = currentHead();
  history.replaceState(null, "", head ? `#${head}` : location.pathname);
  $("undo").disabled = state.busy || !state.turns.length;
}

// -- rendering ------------------------------------------------------------------------------------
function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function render() {
  const box = $("messages");
  box.replaceChildren();
  const lastUser = lastUserTurn();
  if (state.gap && state.turns.length) box.append(element("div", "status gap", "Earlier turns of this conversation were deleted."));
  state.turns.forEach((turn, index) => {
    for (const item of turn.input) box.append(inputView(item, index));
    const reply = element("div", "message assistant");
    for (const item of turn.response?.output ?? []) reply.append(outputView(item));
    const status = turn.response?.status;
    if (status && status !== "completed") reply.append(element("div", "status", statusText(status)));
    if (index === state.turns.length - 1 && lastUser >= 0) {
      reply.append(actions([["Regenerate", () => resend(lastUser, null)]]));
    }
    box.append(reply);
  });
  box.scrollTop = box.scrollHeight;
}

function statusText(status) {
  return { cancelled: "stopped: the server kept the reply as far as it got",
           incomplete: "cut at the token limit", failed: "failed" }[status] || status;
}

function inputView(item, index) {
  if (item.type === "function_call_output") return toolView("result", item.output);
  if (item.type === "function_call") return toolView("call", `${item.name}(${item.arguments})`);
  const view = element("div", `message ${item.role}`);
  view.append(element("div", "text", item.content));
  if (item.role === "user") view.append(actions([["Edit", () => startEdit(view, index, item.content)]]));
  return view;
}

function outputView(item) {
  if (item.type === "reasoning") {
    const details = element("details", "reasoning");
    details.append(element("summary", "", "Reasoning"), element("div", "text", partsText(item.content)));
    return details;
  }
  if (item.type === "function_call") return toolView("call", `${item.name}(${item.arguments})`);
  return element("div", "text", partsText(item.content));
}

function partsText(parts) {
  return (parts ?? []).map((p) => p.text ?? "").join("");
}

function toolView(label, text) {
  const view = element("div", "tool");
  view.append(element("span", "label", `${label}: `), document.createTextNode(text));
  return view;
}

function actions(buttons) {
  const bar = element("div", "actions");
  for (const [label, onClick] of buttons) {
    const button = element("button", "", label);
    button.type = "button";
    button.disabled = state.busy;
    button.addEventListener("click", onClick);
    bar.append(button);
  }
  return bar;
}

function startEdit(view, index, text) {
  if (state.busy) return;
  const area = element("textarea");
  area.value = text;
  area.rows = 3;
  view.replaceChildren(area, actions([["Send", () => resend(index, area.value)], ["Cancel", render]]));
  area.focus();
}

// -- turns ----------------------------------------------------------------------------------------
function lastUserTurn() {
  for (let i = state.turns.length - 1; i >= 0; i--) {
    if (state.turns[i].input.some((item) => item.role === "user")) return i;
  }
  return -1;
}

// Regenerate (text null) or edit-and-resend turn `index`: a new branch from the turn before it.
async function resend(index, text) {
  if (state.busy) return;
  const input = text === null ? state.turns[index].input : [{ type: "message", role: "user", content: text }];
  if (text !== null && !text.trim()) return;
  state.turns = state.turns.slice(0, index);
  await runTurn(input);
}

function undo() {
  if (state.busy) return;
  const index = lastUserTurn();
  state.turns = state.turns.slice(0, Math.max(index, 0));
  setHead();
  render();
  loadConversations();
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (state.busy || !text.trim()) return;
  $("prompt").value = "";
  await runTurn([{ type: "message", role: "user", content: text }]);
}

// One request and, when the page ran the calculate tool, the requests that send its results.
async function runTurn(input) {
  setBusy(true);
  try {
    let turn = await streamTurn(input);
    while (turn?.response?.status === "completed" && $("use-calculator").checked) {
      const results = toolResults(turn.response.output);
      if (!results.length) break;
      turn = await streamTurn(results);
    }
  } catch (error) {
    showError(error);
  } finally {
    setBusy(false);
    setHead();
    render();
    loadConversations();
  }
}

async function streamTurn(input) {
  const turn = { input, response: null };
  state.turns.push(turn);
  render();
  const reply = $("messages").lastElementChild;
  const body = { input, stream: true, store: true, previous_response_id: state.turns.at(-2)?.response?.id ?? null };
  if ($("use-calculator").checked) body.tools = [CALCULATE];
  state.controller = new AbortController();
  const timing = { sent: performance.now(), first: null, end: null };
  let id = null;
  try {
    const response = await api("responses", { method: "POST", body: JSON.stringify(body), signal: state.controller.signal });
    const views = [];
    for await (const event of events(response)) {
      if (event.type === "response.created") id = event.response.id;
      else if (event.type === "response.output_item.added") views[event.output_index] = liveItem(reply, event.item);
      else if (event.type.endsWith(".delta") && event.type !== "response.function_call_arguments.delta") {
        timing.first ??= performance.now();
        views[event.output_index].textContent += event.delta;
        $("messages").scrollTop = $("messages").scrollHeight;
      } else if (event.type === "response.output_item.done" && event.item.type === "function_call") {
        timing.first ??= performance.now();
        views[event.output_index].replaceWith(outputView(event.item));
      } else if (event.type === "response.completed" || event.type === "response.incomplete") {
        turn.response = event.response;
      } else if (event.type === "error") {
        throw new Error(event.message);
      }
    }
    timing.end = performance.now();
  } catch (error) {
    if (error.name !== "AbortError") {
      if (!(await settle(turn, id))) state.turns.pop();
      throw error;
    }
    if (!(await settle(turn, id))) {
      state.turns.pop();
      showError(new Error("Stopped before the server kept anything: the conversation is as it was."));
    }
  } finally {
    state.controller = null;
  }
  showStats(turn.response?.usage, timing);
  return turn.response ? turn : null;
}

// After Stop (or a broken stream): the server keeps what was generated, as response `id`; wait for it.
async function settle(turn, id) {
  if (turn.response || !id) return Boolean(turn.response);
  for (let i = 0; i < 50; i++) {
    const response = await fetch(`${API}/responses/${encodeURIComponent(id)}`, { headers: headers() });
    if (response.ok) {
      turn.response = await response.json();
      return true;
    }
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  return false;
}

// An output item while it streams: its text element (reasoning goes in a collapsed <details>).
function liveItem(reply, item) {
  const view = outputView({ ...item, content: [] });
  reply.insertBefore(view, reply.querySelector(".actions"));
  return view.querySelector(".text") ?? view;
}

function setBusy(busy) {
  state.busy = busy;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("undo").disabled = busy || !state.turns.length;
  $("new-chat").disabled = busy;
  if (busy) $("error").hidden = true;
}

// -- the calculate tool, run here -----------------------------------------------------------------
function toolResults(output) {
  return output.filter((item) => item.type === "function_call").map((call) => {
    let result;
    try {
      if (call.name !== "calculate") throw new Error(`this page has no tool named ${call.name}`);
      result = calculate(JSON.parse(call.arguments).expression);
    } catch (error) {
      result = `error: ${error.message}`;
    }
    return { type: "function_call_output", call_id: call.call_id, output: result };
  });
}

// + - * / and parentheses over numbers, by recursive descent (no eval).
function calculate(expression) {
  const tokens = String(expression).match(/\d+(?:\.\d+)?|\S/g) ?? [];
  let at = 0;
  const peek = () => tokens[at];
  const take = () => tokens[at++];
  const primary = () => {
    const token = take();
    if (token === "(") {
      const value = sum();
      if (take() !== ")") throw new Error("a ( is not closed");
      return value;
    }
    if (token === "-") return -primary();
    if (token === "+") return primary();
    if (token === undefined || !/^\d/.test(token)) throw new Error(`unexpected ${token ?? "end"}`);
    return Number(token);
  };
  const product = () => {
    let value = primary();
    while (peek() === "*" || peek() === "/") {
      const op = take();
      const right = primary();
      if (op === "/" && right === 0) throw new Error("division by zero");
      value = op === "*" ? value * right : value / right;
    }
    return value;
  };
  const sum = () => {
    let value = product();
    while (peek() === "+" || peek() === "-") value = take() === "+" ? value + product() : value - product();
    return value;
  };
  const value = sum();
  if (at < tokens.length) throw new Error(`unexpected ${peek()}`);
  return Number.isInteger(value) ? String(value) : String(Number(value.toFixed(6)));
}

// -- the footer -----------------------------------------------------------------------------------
function showStats(usage, timing) {
  const prompt = usage?.input_tokens;
  const reused = usage?.input_tokens_details?.cached_tokens ?? 0;
  $("stat-prompt").textContent = prompt ?? "–";
  $("stat-reused").textContent = prompt ? `${reused} (${Math.round((100 * reused) / prompt)} %)` : "–";
  const first = timing?.first ? timing.first - timing.sent : null;
  $("stat-ttft").textContent = first === null ? "–" : `${Math.round(first)} ms`;
  const decode = timing?.first && timing.end ? (timing.end - timing.first) / 1000 : 0;
  const generated = (usage?.output_tokens ?? 0) - 1;  // the tokens after the first one
  $("stat-tps").textContent = decode > 0 && generated > 0 ? (generated / decode).toFixed(1) : "–";
}

function showError(error) {
  $("error").textContent = error.message;
  $("error").hidden = false;
}

// -- wiring ---------------------------------------------------------------------------------------
function newChat() {
  if (state.busy) return;
  state.turns = [];
  state.gap = false;
  setHead();
  render();
  showStats(null, null);
  $("prompt").focus();
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) send(event);
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("undo").addEventListener("click", undo);
$("new-chat").addEventListener("click", newChat);
$("sidebar").addEventListener("scroll", onSidebarScroll);
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem("chatkit.apiKey", $("api-key").value);
  $("key-form").hidden = true;
  start();
});

async function start() {
  try {
    const models = await (await api("models")).json();
    $("model-name").textContent = `chatkit · ${models.data[0]?.id ?? ""}`;
  } catch (error) {
    return showError(error);
  }
  const head = location.hash.slice(1);
  if (head) await openConversation(head, true);  // the address's conversation, unless this server lacks it
  else loadConversations();
}

start();
