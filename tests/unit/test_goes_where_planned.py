"""A request served whole goes to the node its plan chose: the choice the admin preview shows is
the node the request is sent to, ties included (the plan and the dispatch weigh the same views)."""

from __future__ import annotations

import pytest

from prefixgate.gateway.nodeclient.fake import FakeNodeClient
from tests.unit.seam_support import harness, prepared

pytestmark = pytest.mark.timeout(10)


# the default policy, and round_robin (not the default): a policy that is nothing but tie-breaks,
# where choosing again at dispatch with the next turn always named another node
@pytest.mark.parametrize("policy", ["prefixgate", "round_robin"])
async def test_a_request_goes_to_the_node_its_preview_named(policy: str) -> None:
    nodes = [FakeNodeClient(f"m{i}") for i in range(3)]
    async with harness(*(("monolithic", c) for c in nodes), policy=policy) as h:
        served = []
        for i in range(6):
            # a prompt of its own each time: no cached prefix, three idle equal nodes, a tie
            prep = prepared(h.pipeline, f"request {i} " + "x" * 1600)
            planned = h.pipeline.preview(prep, {}).monolithic
            assert planned is not None
            ex = await h.pipeline.execute(prep)
            assert ex.decode_node.id == planned.node_id
            served.append(ex.decode_node.id)
            await ex.close()
        assert set(served) == {c.address for c in nodes}  # the ties went round the nodes
