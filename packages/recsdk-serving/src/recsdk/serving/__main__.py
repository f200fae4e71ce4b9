"""``python -m recsdk.serving inspect ROOT``."""

import sys

from recsdk.serving.inspect_root import main

sys.exit(main())
