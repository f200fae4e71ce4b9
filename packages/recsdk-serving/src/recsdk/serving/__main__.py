"""``python -m recsdk.serving inspect ROOT`` and ``python -m recsdk.serving serve ROOT --model ...``."""

import sys

from recsdk.serving.cli import main

sys.exit(main())
