"""Set-up shared by the recsdk-pipeline tests.

One intra-op thread per process, as torchrun gives each of several ranks on one host: the ranks
of :func:`recsdk.data.testing.run_distributed` fork from a forkserver started with this
environment, so a test's 2 (or 3, 4) ranks on this 2-core machine do not each run an OpenMP pool
of 2 threads that spin against each other (a rank's step took 3 to 4 times as long). Set before
torch is imported here; an ``OMP_NUM_THREADS`` given by the caller wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
