"""``prefixgate admin``: the admin API from a terminal, as tables (rich) or ``--json``.

    prefixgate admin [--url http://127.0.0.1:8000] [--token T] [--json] COMMAND ...

Commands: ``nodes`` (``add ROLE ADDRESS``, ``remove ID``, ``drain ID [--undo]``), ``cache``,
``lookup``, ``evict``, ``pin``, ``pins [--tenant T]``, ``usage [--tenant T]``,
``switches [NAME=on|off ...]``. ``--url`` and ``--token`` also
come from ``PREFIXGATE_ADMIN_URL`` / ``PREFIXGATE_ADMIN_TOKEN``. Rendering is pure (JSON in,
``rich`` renderables out); only ``run`` does I/O.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import orjson
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

DEFAULT_URL = "http://127.0.0.1:8000"
SWITCH_NAMES = ("disaggregation", "prefix_routing", "normalization")


class CLIError(Exception):
    """A usage error or an error answer from the gateway, printed without a traceback."""


# -- formatting helpers --------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.3f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def _health(n: dict[str, Any]) -> Text:
    if not n.get("reachable"):
        return Text("unreachable", style="red")
    if n.get("draining"):
        return Text("draining", style="yellow")
    if not n.get("routable"):
        return Text("not routable", style="yellow")
    return Text("ok", style="green")


def _circuit(state: str) -> Text:
    return Text(state, style={"closed": "green", "half_open": "yellow"}.get(state, "red"))


def _table(title: str, columns: Iterable[str | tuple[str, str]]) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in columns:
        name, justify = col if isinstance(col, tuple) else (col, "left")
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    return t


# -- renderers (pure) ----------------------------------------------------------------------------


def render_nodes(data: dict[str, Any]) -> list[RenderableType]:
    t = _table(
        "Nodes",
        [
            "ID",
            "ROLE",
            "ADDRESS",
            "HEALTH",
            "CIRCUIT",
            ("QUEUED", "right"),
            ("RUNNING", "right"),
            ("STREAMS", "right"),
            ("KV USED/CAP", "right"),
            ("PINNED", "right"),
            ("INDEX", "right"),
            ("CONTEXT", "right"),
        ],
    )
    for n in data.get("data", []):
        load, kv = n.get("load", {}), n.get("kv", {})
        t.add_row(
            n["id"],
            n["role"],
            n["address"],
            _health(n),
            _circuit(n.get("circuit", "?")),
            _num(load.get("queued_requests")),
            _num(load.get("running_requests")),
            _num(load.get("active_streams")),
            f"{_num(kv.get('used_blocks'))}/{_num(kv.get('capacity_blocks'))}",
            _num(kv.get("pinned_blocks")),
            _num(kv.get("index_blocks")),
            _num(n.get("max_context_tokens")),
        )
    return [t]


def render_node(n: dict[str, Any]) -> list[RenderableType]:
    return render_nodes({"data": [n]})


def render_cache(data: dict[str, Any]) -> list[RenderableType]:
    idx, tot = data.get("index", {}), data.get("totals", {})
    head = Text.assemble(
        ("Index ", "bold"),
        f"{idx.get('backend')}: {_num(idx.get('total_blocks'))} blocks of {data.get('block_size')} tokens",
        (" (degraded)", "red") if idx.get("degraded") else "",
        ("   Hit ratio ", "bold"),
        f"reported {_pct(tot.get('hit_ratio_reported'))}, predicted {_pct(tot.get('hit_ratio_predicted'))}",
        f" over {_num(tot.get('requests'))} requests, {_num(tot.get('prompt_tokens'))} prompt tokens",
    )
    t = _table(
        "Cache by node",
        [
            "NODE",
            "ROLE",
            ("INDEX BLOCKS", "right"),
            ("KV USED/CAP", "right"),
            ("OCCUPANCY", "right"),
            ("PINNED", "right"),
            ("PROMPT TOK", "right"),
            ("CACHED TOK", "right"),
            ("HIT REPORTED", "right"),
            ("HIT PREDICTED", "right"),
        ],
    )
    for n in data.get("nodes", []):
        t.add_row(
            n["id"],
            n.get("role") or "(gone)",
            _num(n.get("index_blocks")),
            f"{_num(n.get('used_blocks'))}/{_num(n.get('capacity_blocks'))}",
            _pct(n.get("occupancy")),
            _num(n.get("pinned_blocks")),
            _num(n.get("prompt_tokens")),
            _num(n.get("cached_tokens")),
            _pct(n.get("hit_ratio_reported")),
            _pct(n.get("hit_ratio_predicted")),
        )
    return [head, t]


def render_lookup(data: dict[str, Any], all_hashes: bool = False) -> list[RenderableType]:
    d = data.get("decision", {})
    route = (
        f"prefill {d.get('prefill_node')} -> decode {d.get('decode_node')}"
        if d.get("mode") == "disaggregated"
        else f"node {d.get('monolithic_node')}"
    )
    head = Text.assemble(
        ("Decision ", "bold"),
        (f"{d.get('mode')}", "cyan"),
        f": {route}, {_num(d.get('predicted_cached_tokens'))} of {_num(data.get('prompt_tokens'))} "
        f"prompt tokens cached ({_num(d.get('cached_blocks'))} of {_num(data.get('full_blocks'))} blocks)\n",
        ("  mode: ", "bold"),
        f"{d.get('reason')}\n",
        ("  node: ", "bold"),
        f"{d.get('node_reason')}",
    )
    seg = _table(
        "Layout", ["SEGMENT", "LABEL", ("TOKENS", "right"), ("BLOCKS", "right"), ("CACHED", "right")]
    )
    for s in data.get("layout", {}).get("segments", []):
        a, b = s["tokens"]
        ba, bb = s["blocks"]
        seg.add_row(s["kind"], s["label"], f"{a}-{b} ({b - a})", f"{ba}-{bb}", _num(s.get("cached_tokens")))
    nodes = _table(
        "Nodes",
        [
            "NODE",
            "ROLE",
            ("HIT BLOCKS", "right"),
            ("EST TTFT ms", "right"),
            ("QUEUE ms", "right"),
            ("PREFILL ms", "right"),
            ("TRANSFER ms", "right"),
            ("LOAD", "right"),
            "CHOSEN",
        ],
    )
    for n in data.get("nodes", []):
        nodes.add_row(
            n["id"],
            n["role"],
            _num(n.get("hit_blocks")),
            _ms(n.get("estimated_ttft_ms")),
            _ms(n.get("queue_ms")),
            _ms(n.get("prefill_ms")),
            _ms(n.get("transfer_ms")),
            _num(n.get("load", {}).get("outstanding_requests")),
            Text(", ".join(n.get("chosen_for", [])), style="cyan"),
        )
    hashes = data.get("block_hashes", [])
    shown = hashes if all_hashes else hashes[:4]
    more = "" if len(shown) == len(hashes) else f" ... ({len(hashes)} in all; --hashes shows every one)"
    foot = Text.assemble(("Block hashes ", "bold"), " ".join(shown) + more)
    return [head, seg, nodes, foot]


def render_evict(data: dict[str, Any]) -> list[RenderableType]:
    t = _table("Evicted", ["NODE", ("EVICTED BLOCKS", "right"), ("INDEX REMOVED", "right"), "ERROR"])
    for node, r in sorted(data.get("nodes", {}).items()):
        t.add_row(
            node,
            _num(r.get("evicted_blocks")),
            _num(r.get("index_removed")),
            Text(r.get("error") or "", "red"),
        )
    return [t, Text(f"{_num(data.get('evicted_blocks'))} blocks evicted")]


def render_pin(data: dict[str, Any]) -> list[RenderableType]:
    t = _table(
        f"Warmed {_num(data.get('prompt_tokens'))} tokens ({_num(data.get('blocks'))} blocks)",
        [
            "NODE",
            "METHOD",
            ("CACHED TOK", "right"),
            ("COMPUTED TOK", "right"),
            ("PINNED BLOCKS", "right"),
            "PINNED UNTIL",
            "ERROR",
        ],
    )
    for r in data.get("nodes", []):
        until = r.get("pinned_until")
        t.add_row(
            r["node"],
            r.get("method", ""),
            _num(r.get("cached_tokens")),
            _num(r.get("computed_tokens")),
            _num(r.get("pinned_blocks")),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(until)) if until else "-",
            Text(r.get("error") or "", "red"),
        )
    return [t]


def render_switches(data: dict[str, Any]) -> list[RenderableType]:
    t = _table("Switches", ["SWITCH", "STATE"])
    for name, on in data.items():
        t.add_row(name, Text("on", "green") if on else Text("off", "red"))
    return [t]


def render_removed(data: dict[str, Any]) -> list[RenderableType]:
    return [
        Text(
            f"removed {data.get('id')} ({data.get('address')}); the index forgot "
            f"{_num(data.get('index_blocks_forgotten'))} blocks; "
            f"{_num(data.get('cut_in_flight'))} requests cut"
        )
    ]


def render_usage(data: dict[str, Any]) -> list[RenderableType]:
    prices = data.get("prices", {})
    per = prices.get("per_million_tokens", {})
    cur = prices.get("currency", "")
    t = _table(
        f"Usage (prices per million tokens: input {_num(per.get('input_miss'))}, cached input "
        f"{_num(per.get('input_hit'))}, output {_num(per.get('output'))} {cur})",
        [
            "TENANT",
            "MODEL",
            ("REQUESTS", "right"),
            ("PROMPT", "right"),
            ("CACHED", "right"),
            ("COMPUTED", "right"),
            ("OUTPUT", "right"),
            ("HIT", "right"),
            (f"VALUE {cur}".strip(), "right"),
        ],
    )
    rows = list(data.get("data", []))
    total = data.get("totals")
    for r in [*rows, *([{"tenant": "total", "model": "", **total}] if total and len(rows) > 1 else [])]:
        prompt = r.get("prompt_tokens", 0)
        t.add_row(
            r.get("tenant") or '""',
            r.get("model", ""),
            _num(r.get("requests")),
            _num(prompt),
            _num(r.get("cached_tokens")),
            _num(r.get("computed_tokens")),
            _num(r.get("output_tokens")),
            _pct(r.get("cached_tokens", 0) / prompt if prompt else None),
            f"{float(r.get('value', {}).get('total', 0.0)):,.4f}",
        )
    limits = [(g.get("tenant") or '""', u) for g in data.get("limits", []) for u in g.get("data", [])]
    if not limits:
        return [t]
    lt = _table(
        "Rate limits (use in the last minute, every replica)",
        ["TENANT", "KEY", "LIMIT", ("USED", "right"), ("OF", "right"), "SETTING"],
    )
    for tenant, u in limits:
        unit = "tokens/min" if u.get("unit") == "tokens" else "requests/min"
        used, limit = _num(u.get("used")), _num(u.get("limit"))
        lt.add_row(tenant, u.get("key", ""), unit, used, limit, u.get("setting", ""))
    return [t, lt]


def render_pins(data: dict[str, Any]) -> list[RenderableType]:
    t = _table("Tenants' pins", ["TENANT", "NODE", ("BLOCKS", "right"), ("ENDS IN S", "right")])
    now = time.time()
    for r in data.get("data", []):
        ends = _ms(r.get("until", now) - now)
        t.add_row(r.get("tenant") or '""', r.get("node", ""), _num(r.get("blocks")), ends)
    return [t]


# -- request bodies ------------------------------------------------------------------------------


def _read_text(value: str) -> str:
    """``@path`` reads a file (``@-`` stdin); anything else is the text itself."""
    if value == "@-":
        return sys.stdin.read()
    if value.startswith("@"):
        return Path(value[1:]).read_text(encoding="utf-8")
    return value


def completion_body(args: argparse.Namespace, *, required: bool = True) -> dict[str, Any]:
    """A completion-shaped body from ``--body``, ``--prompt``, ``--system``/``--message``, documents."""
    body: dict[str, Any] = {}
    if getattr(args, "body", None):
        loaded = orjson.loads(_read_text("@" + args.body if not args.body.startswith("@") else args.body))
        if not isinstance(loaded, dict):
            raise CLIError("--body must hold a JSON object")
        body.update(loaded)
    messages: list[dict[str, str]] = []
    if getattr(args, "system", None):
        messages.append({"role": "system", "content": _read_text(args.system)})
    for m in getattr(args, "message", None) or []:
        role, sep, text = m.partition(":")
        if not sep or not role:
            raise CLIError(f"--message takes ROLE:TEXT, got {m!r}")
        messages.append({"role": role, "content": _read_text(text)})
    if messages:
        body["messages"] = messages
    if getattr(args, "prompt", None) is not None:
        body["prompt"] = _read_text(args.prompt)
    docs = []
    for d in getattr(args, "document", None) or []:
        doc_id, sep, text = d.partition("=")
        if not sep:
            raise CLIError(f"--document takes ID=TEXT or ID=@FILE, got {d!r}")
        docs.append({"id": doc_id, "text": _read_text(text)})
    if docs:
        body["documents"] = docs
    if getattr(args, "document_id", None):
        body["document_ids"] = list(args.document_id)
    for key in ("model", "tenant", "user"):
        if getattr(args, key, None):
            body[key] = getattr(args, key)
    if required and "messages" not in body and "prompt" not in body:
        raise CLIError("give the request: --prompt TEXT, --message ROLE:TEXT (and --system), or --body FILE")
    return body


def _switch_updates(items: list[str]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or value.lower() not in ("on", "off", "true", "false", "1", "0"):
            raise CLIError(f"switches take NAME=on|off, got {item!r}")
        if name not in SWITCH_NAMES:
            raise CLIError(f"unknown switch {name!r}; known: {', '.join(SWITCH_NAMES)}")
        out[name] = value.lower() in ("on", "true", "1")
    return out


# -- commands ------------------------------------------------------------------------------------

Renderer = Callable[[dict[str, Any]], list[RenderableType]]


def plan_request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, Renderer]:
    """(method, path, json body, renderer) of the admin call ``args`` asks for."""
    cmd = args.admin_command
    if cmd == "nodes":
        action = getattr(args, "nodes_action", None) or "list"
        if action == "add":
            return "POST", "/admin/nodes", {"role": args.role, "address": args.address}, render_node
        if action == "remove":
            return "DELETE", f"/admin/nodes/{quote(args.node_id, safe='')}", None, render_removed
        if action == "drain":
            return (
                "POST",
                f"/admin/nodes/{quote(args.node_id, safe='')}/drain",
                {"drain": not args.undo},
                render_node,
            )
        return "GET", "/admin/nodes", None, render_nodes
    if cmd == "cache":
        return "GET", "/admin/cache", None, render_cache
    if cmd == "lookup":
        all_hashes = bool(args.hashes)
        return "POST", "/admin/cache/lookup", completion_body(args), lambda d: render_lookup(d, all_hashes)
    if cmd == "evict":
        body = completion_body(args, required=False)
        if args.node:
            body["node"] = args.node
        if args.hash:
            body["block_hashes"] = list(args.hash)
        if args.all:
            body["all"] = True
        if not body:
            raise CLIError("say what to evict: --prompt/--message, --hash, --all, or --node alone")
        return "POST", "/admin/cache/evict", body, render_evict
    if cmd == "pin":
        body = completion_body(args)
        body["pin_seconds"] = args.seconds
        if args.node:
            body["nodes"] = list(args.node)
        elif args.nodes:
            body["nodes"] = args.nodes
        return "POST", "/admin/cache/pin", body, render_pin
    if cmd in ("usage", "pins"):
        path = "/admin/usage" if cmd == "usage" else "/admin/cache/pins"
        if args.tenant is not None:
            path += "?" + urlencode({"tenant": args.tenant})
        return "GET", path, None, render_usage if cmd == "usage" else render_pins
    if cmd == "switches":
        updates = _switch_updates(args.set)
        if updates:
            return "PUT", "/admin/switches", dict(updates), render_switches
        return "GET", "/admin/switches", None, render_switches
    raise CLIError(f"unknown admin command {cmd!r}")


def _option(args: argparse.Namespace, name: str, env: str, default: str | None) -> str | None:
    value = getattr(args, name, None)
    return value if value is not None else os.environ.get(env, default)


def _console(stream: Any) -> Console:
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 200
    return Console(file=stream, width=width, soft_wrap=False)


def run(args: argparse.Namespace) -> int:
    out, err = _console(sys.stdout), _console(sys.stderr)
    url = (_option(args, "url", "PREFIXGATE_ADMIN_URL", DEFAULT_URL) or DEFAULT_URL).rstrip("/")
    token = _option(args, "token", "PREFIXGATE_ADMIN_TOKEN", None)
    try:
        method, path, body, render = plan_request(args)
    except (CLIError, OSError, orjson.JSONDecodeError) as e:
        err.print(f"[red]prefixgate admin:[/red] {e}", highlight=False)
        return 2
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=url, timeout=getattr(args, "timeout", None) or 60.0) as client:
            resp = client.request(method, path, json=body, headers=headers)
    except httpx.HTTPError as e:
        err.print(f"[red]prefixgate admin:[/red] cannot reach {url}: {e}", highlight=False)
        return 2
    try:
        data = resp.json()
    except ValueError:
        data = {"error": {"message": resp.text[:500]}}
    if resp.status_code >= 400:
        msg = data.get("error", {}).get("message") if isinstance(data, dict) else None
        err.print(f"[red]error {resp.status_code}:[/red] {msg or resp.text[:500]}", highlight=False)
        return 1
    if getattr(args, "json", False):
        sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    for part in render(data):
        out.print(part, highlight=False)
    return 0


# -- argument parsing ----------------------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    """Options accepted before or after the command (``SUPPRESS``: the later one wins, none unset)."""
    p = argparse.ArgumentParser(add_help=False)
    s = argparse.SUPPRESS
    p.add_argument("--url", default=s, help=f"gateway base URL (default {DEFAULT_URL}, PREFIXGATE_ADMIN_URL)")
    p.add_argument("--token", default=s, help="admin token (PREFIXGATE_ADMIN_TOKEN)")
    p.add_argument("--json", action="store_true", default=s, help="print the JSON answer")
    p.add_argument("--timeout", type=float, default=s, help="seconds to wait for the answer (default 60)")
    return p


def _request_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="completion-form prompt (TEXT, @FILE or @- for stdin)")
    p.add_argument("--system", help="system message (TEXT or @FILE)")
    p.add_argument("--message", action="append", metavar="ROLE:TEXT", help="chat message (repeat)")
    p.add_argument("--document", action="append", metavar="ID=TEXT", help="document ID=TEXT or ID=@FILE")
    p.add_argument("--document-id", action="append", metavar="ID", help="registered document id")
    p.add_argument("--body", metavar="FILE", help="JSON request body from a file (- for stdin)")
    p.add_argument("--model")
    p.add_argument("--tenant", help="tenant whose cache namespace to use")
    p.add_argument("--user")


def add_admin_parser(subparsers: Any, text: str) -> None:
    common = _common()
    admin = subparsers.add_parser(
        "admin",
        parents=[common],
        help=text,
        description="The admin API from a terminal: tables, or the JSON answers with --json.",
    )
    sub = admin.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")

    nodes = sub.add_parser("nodes", parents=[common], help="list, add, remove or drain nodes")
    nsub = nodes.add_subparsers(dest="nodes_action", metavar="ACTION")
    nsub.add_parser("list", parents=[common], help="every node (default)")
    add = nsub.add_parser("add", parents=[common], help="register a node")
    add.add_argument("role", choices=["prefill", "decode", "monolithic"])
    add.add_argument("address", help="host:port of the node's gRPC server")
    rm = nsub.add_parser("remove", parents=[common], help="forget a node (cuts its in-flight work)")
    rm.add_argument("node_id")
    drain = nsub.add_parser("drain", parents=[common], help="no new work for a node; running work finishes")
    drain.add_argument("node_id")
    drain.add_argument("--undo", action="store_true", help="take new work again")

    sub.add_parser("cache", parents=[common], help="index totals, occupancy and hit ratios per node")

    lookup = sub.add_parser("lookup", parents=[common], help="explain how a request would be routed")
    _request_args(lookup)
    lookup.add_argument("--hashes", action="store_true", help="print every block hash")

    evict = sub.add_parser("evict", parents=[common], help="evict blocks from nodes and the index")
    _request_args(evict)
    evict.add_argument("--node", help="only on this node (alone: everything on it)")
    evict.add_argument("--hash", action="append", metavar="HEX", help="a block hash (repeat)")
    evict.add_argument("--all", action="store_true", help="everything")

    pin = sub.add_parser("pin", parents=[common], help="warm a prompt on nodes and pin it")
    _request_args(pin)
    pin.add_argument("--seconds", type=float, required=True, help="how long to keep it pinned")
    pin.add_argument("--nodes", type=int, help="how many nodes (default 1: the routed one)")
    pin.add_argument("--node", action="append", metavar="ID", help="a named node (repeat)")

    usage = sub.add_parser("usage", parents=[common], help="tokens and their value per tenant and model")
    usage.add_argument("--tenant", help="only this tenant")
    pins = sub.add_parser("pins", parents=[common], help="what tenants hold pinned, per node")
    pins.add_argument("--tenant", help="only this tenant")

    sw = sub.add_parser("switches", parents=[common], help="show or set the runtime switches")
    sw.add_argument("set", nargs="*", metavar="NAME=on|off")

    admin.set_defaults(func=run)
