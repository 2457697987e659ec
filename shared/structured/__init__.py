"""Structured output: constraints on what a request may generate.

``constraint`` is torch-free (the router and the protos use it); ``grammar``
compiles constraints with xgrammar and fills token bitmasks for the sampler.
"""
