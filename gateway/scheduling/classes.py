"""Priority classes: what a request's class says of its place in the queue and of its deadline.

A request names its class with the ``x-prefixgate-priority-class`` header, or gives a bare
``priority`` in its body as vLLM takes it (an integer, lower goes first, 0 by default); a class
gives the priority, whether the request may be refused early (``sheddable``) and a default TTFT
target. Classes are configured as ``priority_classes = ["NAME:priority=P;ttft_slo_ms=MS;sheddable", ...]``;
the class ``default`` always exists (priority 0, no target, not sheddable) unless configured.
Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prefixgate.gateway.core.errors import InvalidRequest
from prefixgate.gateway.records import record

DEFAULT_CLASS = "default"
PRIORITY_CLASS_HEADER = "x-prefixgate-priority-class"
TTFT_SLO_HEADER = "x-prefixgate-ttft-slo-ms"
MAX_PRIORITY = 1 << 20  # |priority| at most this: vLLM's field is an int, bounded here
MAX_SLO_MS = 3_600_000.0


@dataclass(frozen=True, slots=True)
class PriorityClass:
    name: str
    priority: int = 0  # lower goes first (vLLM's meaning)
    sheddable: bool = False  # refused at once (429) when its deadline cannot be met
    ttft_slo_s: float = 0.0  # the first-token target of its requests (0: none)


@record
class Schedule:
    """A request's place in the scheduler: its band, its deadline rule, whether it may be shed."""

    class_name: str = DEFAULT_CLASS
    priority: int = 0
    sheddable: bool = False
    ttft_slo_s: float = 0.0  # 0: no target


DEFAULT_SCHEDULE = Schedule()


def parse_class(entry: str) -> PriorityClass:
    """``NAME:priority=P;ttft_slo_ms=MS;sheddable`` (every option optional); ValueError naming
    what is wrong."""
    name, _, opts = entry.partition(":")
    name = name.strip()
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"priority class {entry!r}: the name must be letters, digits, '-' or '_'")
    priority, sheddable, slo_s = 0, False, 0.0
    for raw in filter(None, (o.strip() for o in opts.split(";"))):
        key, eq, value = raw.partition("=")
        try:
            if key == "priority" and eq:
                priority = int(value)
                if abs(priority) > MAX_PRIORITY:
                    raise ValueError
            elif key == "ttft_slo_ms" and eq:
                ms = float(value)
                if not 0 <= ms <= MAX_SLO_MS:
                    raise ValueError
                slo_s = ms / 1000.0
            elif key == "sheddable" and (not eq or value in ("true", "false")):
                sheddable = value != "false"
            else:
                raise KeyError(key)
        except KeyError:
            raise ValueError(
                f"priority class {name!r}: unknown option {raw!r} (priority, ttft_slo_ms, sheddable)"
            ) from None
        except ValueError:
            raise ValueError(f"priority class {name!r}: bad value in {raw!r}") from None
    return PriorityClass(name, priority, sheddable, slo_s)


def class_table(entries: Iterable[str]) -> dict[str, PriorityClass]:
    """The configured classes by name, ``default`` added when not configured."""
    table: dict[str, PriorityClass] = {}
    for entry in entries:
        cls = parse_class(entry)
        if cls.name in table:
            raise ValueError(f"priority class {cls.name!r} is configured twice")
        table[cls.name] = cls
    table.setdefault(DEFAULT_CLASS, PriorityClass(DEFAULT_CLASS))
    return table


def slo_ms(raw: str) -> float | None:
    """The ``x-prefixgate-ttft-slo-ms`` header's target (None: not sent); a 400 naming the
    header when it is not a number of milliseconds within bounds."""
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= MAX_SLO_MS:
        raise InvalidRequest(
            f"{TTFT_SLO_HEADER} must be a number of milliseconds in (0, {MAX_SLO_MS:.0f}], got {raw[:40]!r}",
            param=TTFT_SLO_HEADER,
            code="invalid_header",
        )
    return ms


def unknown_class(classes: Mapping[str, PriorityClass], name: str) -> InvalidRequest | None:
    """The client's 400 for a class name not configured (None: it is)."""
    if not name or name in classes:
        return None
    return InvalidRequest(
        f"{PRIORITY_CLASS_HEADER}: unknown priority class {name[:64]!r}; "
        f"configured: {', '.join(sorted(classes))}",
        param=PRIORITY_CLASS_HEADER,
        code="invalid_header",
    )


def schedule_of(
    classes: Mapping[str, PriorityClass],
    class_name: str | None,
    body_priority: int | None,
    slo_ms: float | None,
) -> Schedule:
    """A request's schedule: its class (``default`` when it names none), the body's
    ``priority`` over the class's, the ``x-prefixgate-ttft-slo-ms`` header over the class's
    target. The caller has checked the name exists (``unknown_class``)."""
    cls = classes[class_name or DEFAULT_CLASS]
    priority = cls.priority if body_priority is None else body_priority
    slo_s = cls.ttft_slo_s if slo_ms is None else slo_ms / 1000.0
    return Schedule(cls.name, priority, cls.sheddable, slo_s)
