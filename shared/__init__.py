"""Cleave's engine core and the code every service imports.

Importing this package sets one process-wide default before torch loads its
OpenMP runtime: ``GOMP_SPINCOUNT=30000`` (unless ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` is already set). An engine step on the CPU has hundreds of
short parallel regions; a thread that sleeps between them must be woken for the
next one, which on a virtual machine costs more than the region itself (a
1,000-iteration spin ran the offline benchmark 1.25x slower than 30,000 on a
quiet 2-core machine). libgomp's default, 300,000, keeps idle threads burning a
core for long after a step. Spinning only pays while the cores are free: the
engine's thread governor (``shared.engine.cpu_threads``) drops a step to fewer
threads when other processes want the cores.
"""

import os

# What this package set (not the user): benchmark children of other engines get the user's environment.
DEFAULTED_ENV: dict[str, str] = {}
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    DEFAULTED_ENV["GOMP_SPINCOUNT"] = os.environ["GOMP_SPINCOUNT"] = "30000"
