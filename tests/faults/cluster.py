"""The fault drills' cluster and load driver live in ``prefixgate.bench.drill_cluster`` (the chaos
benchmark starts the same clusters); the drills import them from here."""

from __future__ import annotations

from prefixgate.bench.drill_cluster import Cluster as Cluster
from prefixgate.bench.drill_cluster import NodeProc as NodeProc
from prefixgate.bench.drill_cluster import Outcome as Outcome
from prefixgate.bench.drill_cluster import Tally as Tally
from prefixgate.bench.drill_cluster import drive as drive
from prefixgate.bench.drill_cluster import one as one
