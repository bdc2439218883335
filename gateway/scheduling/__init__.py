"""Scheduling: which waiting request goes next, which is refused early, and how much each tenant
may send. Pure: the caller passes the clock, so the live gateway and the trace simulator run the
same code."""
