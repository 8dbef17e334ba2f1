"""``python -m pdserve.bench.autoscale_sim`` (see ``pdserve.bench.autoscale_sim.cli``)."""

import sys

from pdserve.bench.autoscale_sim.cli import main

sys.exit(main())
