"""``python -m pdserve.bench``: the `pdserve bench` program (see ``pdserve.bench.cli``)."""

import sys

from pdserve.bench.cli import main

sys.exit(main())
