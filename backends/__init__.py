"""Inference nodes: the gRPC ``prefixgate.v1.Node`` server and its engines.

- ``backends.server.start_node(role, host, port=0, ...) -> NodeServer`` starts a node in the
  running loop (``.port``, ``.address``, ``.node``, ``await .stop()``); ``serve(...)`` runs one
  until SIGINT/SIGTERM; ``backends.cli`` is ``prefixgate node`` / ``python -m backends``.
- ``backends.node.Node``: what every rpc does, minus the wire (pool, queues, KV handles, events).
- ``backends.pool.BlockPool``: the paged KV block pool (pure). ``backends.events.EventLog``:
  numbered pool changes. ``backends.profiles``: calibrated cost profiles.
- ``backends.engine.Engine``: the compute contract; ``backends.sim.engine.SimEngine`` implements it.
"""
