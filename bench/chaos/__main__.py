"""``python -m pdserve.bench.chaos`` (see ``run.py``)."""

import sys

from pdserve.bench.chaos.run import main

sys.exit(main())
