"""``RequestContext.with_body`` builds the context field by field (``replace`` costs every
request a walk over the fields): it must keep every field but the body size, those added later too."""

from __future__ import annotations

from dataclasses import fields, replace

from prefixgate.gateway.core.request import Credentials, RequestContext


def test_with_body_keeps_every_other_field_as_replace_does() -> None:
    given = {
        "tenant": "acme",
        "request_id": "r-1",
        "credentials": Credentials.ADMIN,
        "body_bytes": 7,
        "key_id": "k-1",
        "priority_class": "batch",
        "ttft_slo_ms": 250.0,
    }
    assert {f.name for f in fields(RequestContext)} == set(given)  # a new field is given here too
    ctx = RequestContext(**given)  # type: ignore[arg-type]
    assert ctx.with_body(2048) == replace(ctx, body_bytes=2048)
    assert ctx.with_body(2048).body_bytes == 2048 and ctx.body_bytes == 7
