"""``cleave planner``: sets the prefill and decode pools' replica counts from their latency."""
