"""Set-up shared by the recsdk-pipeline tests: one intra-op thread per process and rank (why:
:func:`recsdk.data.testing.run_distributed`); an ``OMP_NUM_THREADS`` given by the caller wins."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
