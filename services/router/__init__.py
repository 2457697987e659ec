"""OpenAI-compatible HTTP router in front of Cleave's prefill and decode workers (imports no torch)."""
