"""A record (``gateway.records``) is a frozen dataclass to the type checker and a plain slotted
one when it is made: it compares, hashes and is replaced as a frozen one, and an assignment to
one of its fields is refused by the type check CI runs (``mypy --strict``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mypy import api

from prefixgate.gateway.records import record


@record
class Pair:
    left: int
    right: str = "r"


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenPair:
    left: int
    right: str = "r"


def test_a_record_is_a_value_as_a_frozen_dataclass_is() -> None:
    a, b = Pair(1), Pair(1, "r")
    assert a == b and hash(a) == hash(b) and {a: "x"}[b] == "x"
    assert hash(a) == hash(FrozenPair(1))  # hashed by the same fields the same way
    assert dataclasses.replace(a, left=2) == Pair(2) and a.left == 1
    assert not hasattr(a, "__dict__")  # slotted: no attribute outside its fields
    assert [f.name for f in dataclasses.fields(a)] == ["left", "right"]


def test_the_type_check_refuses_an_assignment_to_a_records_field(tmp_path: Path) -> None:
    source = tmp_path / "uses_a_record.py"
    source.write_text(
        "import dataclasses\n"
        "from prefixgate.gateway.records import record\n\n\n"
        "@record\n"
        "class Pair:\n"
        "    left: int\n\n\n"
        "p = Pair(1)\n"
        "q = dataclasses.replace(p, left=2)\n"
        "n: int = q.left\n"
        "p.left = 3\n"
    )
    out, _err, status = api.run(["--strict", "--no-incremental", "--no-error-summary", str(source)])
    assert status == 1
    (error,) = out.splitlines()
    assert error.startswith(f"{source}:13: error:") and "read-only" in error, out
