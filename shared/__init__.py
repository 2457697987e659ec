"""Cleave's engine core and the code every service imports.

Importing this package sets one process-wide default before torch loads its
OpenMP runtime: ``GOMP_SPINCOUNT=1000`` (unless ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` is already set). libgomp's default has idle threads spin
for ~300k iterations after every parallel region; an engine step has hundreds of
short regions, so on a box where other processes (the other workers of
``cleave serve``, or anything else) want the same cores, the spinning threads
steal the cycles the working ones need. On a loaded 2-core machine this was the
difference between 24 and 118 output tokens/s at 2 threads; a short spin then a
futex sleep costs a quiet machine a few microseconds per region.
"""

import os

# What this package set (not the user): benchmark children of other engines get the user's environment.
DEFAULTED_ENV: dict[str, str] = {}
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    DEFAULTED_ENV["GOMP_SPINCOUNT"] = os.environ["GOMP_SPINCOUNT"] = "1000"
