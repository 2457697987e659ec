"""Cleave's services. Importing ``shared`` first applies its OpenMP default before torch loads."""

import shared  # noqa: F401
