"""Inference nodes: the gRPC server (``prefixgate.v1.Node`` and the SMG engine protocol's
``sglang.grpc.scheduler.SglangScheduler``) and its engines.

- ``backends.server.start_node(role, host, port=0, ...) -> NodeServer`` starts a node in the
  running loop (``.port``, ``.address``, ``.node``, ``await .stop()``); ``serve(...)`` runs one
  until SIGINT/SIGTERM; ``backends.cli`` is ``prefixgate node`` / ``python -m prefixgate.backends``.
- ``backends.node.Node``: what every rpc does, minus the wire (pool, queues, KV handles, events).
- ``backends.pool.BlockPool``: the paged KV block pool (pure). ``backends.events.EventLog``:
  numbered pool changes. ``backends.profiles``: calibrated cost profiles.
- ``backends.engine.Engine``: the compute contract; ``backends.sim.engine.SimEngine`` and
  ``backends.tiny.engine.TinyEngine`` implement it.
- ``backends.smg_service``: the SMG engine protocol over ``Node`` (``backends.smg_convert``: its
  pure conversions). ``backends.http_api``: the OpenAI-compatible HTTP endpoint (requests in:
  ``http_requests``; answers out: ``http_wire``; its PD legs: ``http_pd``).
- ``backends.pd``: a node's PD roles for every face (the prefill leg's room meeting and push, the
  decode leg's handshake, vLLM's relay), over ``backends.bootstrap`` (pairing by room).
- ``backends.convert`` / ``backends.stats``: ``prefixgate.v1`` messages <-> the node's types
  (``stats`` also gives the gateway's client its ``NodeStatus``); ``backends.errors``: node
  errors and the status each face answers with. ``backends.hftok``: the Hugging Face tokenizer
  every node ships.
"""
