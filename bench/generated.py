"""Generated workloads: OpenAI chat requests that show what normalization and routing buy.

Every request is a real chat body (``messages``, the ``documents`` extension, ``tools``); its
block hashes come from rendering it exactly as the gateway does (``prefixgate.openai.normalize.
render_chat`` with normalization on or off), tokenizing with ``bytes4`` and hashing with
``cachetier.hashing.block_hashes``. Text is deterministic word salad (``bench.textgen``).

- ``rag``: one knowledge base; each question retrieves ``k`` chunks of its topic (topics
  Zipf-popular), the retriever returning them in a random order.
- ``chat``: multi-turn sessions under a few system prompts; some clients send the system
  prompt split in two messages and with CRLF line endings (same meaning, other bytes).
- ``agent``: agent runs with a large tool catalogue whose JSON key order varies from run to run,
  each step resending the conversation with tool calls and results.
- ``longdoc``: many questions over a few long documents, some comparing two documents given
  in either order.

Arrivals: sessions (or single questions) start as a Poisson process of ``rate`` per second;
later turns follow after exponential think times.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from prefixgate.bench.textgen import segment_text
from prefixgate.bench.workload_types import Request, Workload, WorkloadOptions, sample
from prefixgate.cachetier.hashing import block_hashes
from prefixgate.cachetier.tokenizer import Bytes4Tokenizer
from prefixgate.openai.normalize import Document, render_chat

Message = dict[str, Any]


@dataclass(slots=True)
class _Draft:
    t: float
    session: int
    messages: list[Message]
    output_tokens: int
    documents: list[dict[str, str]] | None = None
    tools: list[dict[str, Any]] | None = None


def _text(rng: random.Random, salt: str, lo: int, hi: int, line_words: int = 14) -> str:
    return segment_text(rng.getrandbits(62), rng.randint(lo, hi), salt, line_words=line_words)


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


# -- rag ---------------------------------------------------------------------------------------


def _rag(rng: random.Random, n: int, rate: float) -> list[_Draft]:
    system = _text(rng, "rag-sys", 300, 300)
    chunks = [
        {"id": f"kb-{i:04d}", "text": segment_text(i, rng.randint(250, 600), "rag-kb", line_words=12)}
        for i in range(400)
    ]
    topics = [rng.sample(range(len(chunks)), 12) for _ in range(60)]
    weights = _zipf_weights(len(topics), 1.1)
    out: list[_Draft] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        topic = rng.choices(topics, weights)[0]
        picked = list(topic[:6])
        if rng.random() < 0.3:  # the retriever's ranking shifts a little between questions
            picked[rng.randrange(6)] = rng.choice(topic[6:])
        rng.shuffle(picked)  # scores tie-break differently every time
        docs = [chunks[j] for j in picked]
        question = _text(rng, "rag-q", 20, 80)
        msgs: list[Message] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        out.append(_Draft(t, i, msgs, rng.randint(100, 400), documents=docs))
    return out


# -- chat --------------------------------------------------------------------------------------


def _system_variants(text: str) -> list[list[Message]]:
    """The same system prompt as different clients send it."""
    head, sep, tail = text.partition("\n\n")
    split = [{"role": "system", "content": head}, {"role": "system", "content": tail}] if sep else []
    return [
        [{"role": "system", "content": text}],
        [{"role": "system", "content": text.replace("\n", "\r\n") + "  "}],
        split or [{"role": "system", "content": text}],
    ]


def _chat(rng: random.Random, n: int, rate: float) -> list[_Draft]:
    # Two paragraphs: split at the blank line, the prompt normalizes to the same bytes.
    systems = [
        _text(rng, "chat-sys", 800, 800) + "\n\n" + _text(rng, "chat-sys", 800, 1200) for _ in range(3)
    ]
    out: list[_Draft] = []
    t = 0.0
    sid = 0
    while len(out) < n:
        t += rng.expovariate(rate)
        variant = rng.choices(range(3), [0.6, 0.2, 0.2])[0]
        head = _system_variants(systems[rng.randrange(len(systems))])[variant]
        history: list[Message] = []
        turns = 1 + min(int(rng.expovariate(1 / 5.0)), 30)
        ts = t
        for _ in range(turns):
            history.append({"role": "user", "content": _text(rng, "chat-u", 50, 400)})
            reply = rng.randint(100, 400)
            out.append(_Draft(ts, sid, [*head, *history], reply))
            history.append({"role": "assistant", "content": _text(rng, "chat-a", reply, reply)})
            ts += rng.expovariate(1 / 30.0)
        sid += 1
    return out


# -- agent -------------------------------------------------------------------------------------


def _tool(rng: random.Random, i: int) -> dict[str, Any]:
    props = {
        f"arg_{j}": {
            "type": rng.choice(["string", "integer", "boolean"]),
            "description": _text(rng, "tool-a", 8, 40),
        }
        for j in range(rng.randint(2, 6))
    }
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i:02d}",
            "description": _text(rng, "tool-d", 60, 200),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)[:1]},
        },
    }


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON with every object's keys in a random order."""
    if isinstance(value, Mapping):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


def _agent(rng: random.Random, n: int, rate: float) -> list[_Draft]:
    system = _text(rng, "agent-sys", 600, 600)
    tools = [_tool(rng, i) for i in range(40)]
    out: list[_Draft] = []
    t = 0.0
    sid = 0
    while len(out) < n:
        t += rng.expovariate(rate)
        msgs: list[Message] = [
            {"role": "system", "content": system},
            {"role": "user", "content": _text(rng, "agent-task", 100, 300)},
        ]
        steps = 1 + min(int(rng.expovariate(1 / 5.0)), 20)
        run_tools = _shuffled(tools, rng)  # each agent process builds its dicts its own way
        ts = t
        for step in range(steps):
            out.append(_Draft(ts, sid, list(msgs), rng.randint(30, 200), tools=run_tools))
            call_id = f"call_{sid}_{step}"
            name = f"tool_{rng.randrange(len(tools)):02d}"
            msgs.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": '{"arg_0": "x"}'},
                        }
                    ],
                }
            )
            msgs.append(
                {"role": "tool", "tool_call_id": call_id, "content": _text(rng, "agent-r", 200, 2000)}
            )
            ts += rng.expovariate(1 / 5.0)
        sid += 1
    return out


# -- longdoc -----------------------------------------------------------------------------------


def _longdoc(rng: random.Random, n: int, rate: float) -> list[_Draft]:
    system = _text(rng, "doc-sys", 200, 200)
    docs = [
        {"id": f"doc-{i}", "text": segment_text(i, rng.randint(20_000, 100_000), "longdoc", line_words=16)}
        for i in range(8)
    ]
    weights = _zipf_weights(len(docs), 0.8)
    out: list[_Draft] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        a = rng.choices(range(len(docs)), weights)[0]
        chosen = [docs[a]]
        if rng.random() < 0.2:  # compare with another document, listed in either order
            b = rng.choice([j for j in range(len(docs)) if j != a])
            chosen = [docs[a], docs[b]] if rng.random() < 0.5 else [docs[b], docs[a]]
        msgs: list[Message] = [
            {"role": "system", "content": system},
            {"role": "user", "content": _text(rng, "doc-q", 20, 120)},
        ]
        out.append(_Draft(t, i, msgs, rng.randint(100, 600), documents=chosen))
    return out


# name -> (generator, default requests, default arrivals per second at time scale 1)
GENERATORS: dict[str, tuple[Callable[[random.Random, int, float], list[_Draft]], int, float]] = {
    "rag": (_rag, 12_000, 300.0),
    "chat": (_chat, 12_000, 30.0),
    "agent": (_agent, 4_000, 20.0),
    "longdoc": (_longdoc, 1_500, 3.0),
}


def _body(d: _Draft) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": d.messages, "max_tokens": d.output_tokens}
    if d.documents:
        body["documents"] = d.documents
    if d.tools:
        body["tools"] = d.tools
        body["tool_choice"] = "none"  # the tools shape the prompt; our engines make no tool calls
    return body


def request_hashes(body: Mapping[str, Any], opts: WorkloadOptions) -> tuple[int, list[int]]:
    """(prompt tokens, block hashes) of a chat body, rendered as the gateway renders it."""
    docs = [Document(str(d["id"]), str(d["text"])) for d in body.get("documents") or ()]
    layout = render_chat(body["messages"], documents=docs, tools=body.get("tools"), normalize=opts.normalize)
    tokens = Bytes4Tokenizer().encode(layout.text)
    return len(tokens) // 4, block_hashes(tokens, opts.block_size, opts.namespace().root())


def generate(fmt: str, opts: WorkloadOptions) -> Workload:
    gen, default_n, default_rate = GENERATORS[fmt]
    n = opts.requests or opts.limit or default_n
    rate = opts.rate or default_rate
    drafts = gen(random.Random(f"{fmt}:{opts.seed}"), n, rate)
    drafts.sort(key=lambda d: d.t)
    drafts = drafts[:n]
    scale = opts.time_scale or 1.0
    reqs: list[Request] = []
    for i, d in enumerate(drafts):
        body = _body(d)
        tokens, hashes = request_hashes(body, opts)
        reqs.append(
            Request(
                index=i,
                arrival_s=d.t / scale,
                prompt_tokens=tokens,
                block_hashes=tuple(hashes),
                output_tokens=d.output_tokens,
                session=d.session,
                body=body,
            )
        )
    reqs = [replace(r, index=j) for j, r in enumerate(sample(reqs, opts))]
    norm = "on" if opts.normalize else "off"
    return Workload(
        name=fmt,
        block_size=opts.block_size,
        requests=reqs,
        description=f"generated {fmt}: {len(reqs)} requests, {rate:g}/s / {scale:g}, normalization {norm}",
        params={
            "requests": n,
            "rate": rate,
            "time_scale": scale,
            "normalize": opts.normalize,
            "seed": opts.seed,
        },
    )
