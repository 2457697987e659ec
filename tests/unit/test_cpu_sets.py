"""CPU lists (``--service-cpus``) as taskset and cpusets write them."""

from __future__ import annotations

import pytest

from shared.cpu_sets import format_cpus, parse_cpus


@pytest.mark.parametrize(
    "text,cpus", [("0", {0}), ("3", {3}), ("0-3", {0, 1, 2, 3}), ("0-1,8", {0, 1, 8}), (" 2 , 4-5", {2, 4, 5})]
)
def test_parses_lists_and_ranges(text, cpus):
    assert parse_cpus(text) == frozenset(cpus)


@pytest.mark.parametrize("text", ["", "a", "-1", "1-", "3-1", "0,,1", "0-2-4", "1.5"])
def test_refuses_what_is_not_a_cpu_list(text):
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpus(text)


def test_formats_what_it_parses():
    assert format_cpus(parse_cpus("4-6,0")) == "0,4,5,6"
