"""CPU lists as taskset and cpusets write them ("0-3,8"); no torch, for the launcher."""

from __future__ import annotations


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as taskset and cpusets write it ("0", "0-3,8"); ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0 or 0-3,8)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} ({part.strip()} runs backwards)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))
