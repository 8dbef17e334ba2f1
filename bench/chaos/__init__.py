"""Faults under load: ``python -m pdserve.bench.chaos`` (``run.py``), the analysis of what
each fault cost (``analysis.py``, pure), the load that keeps every token (``load.py``), the
faults (``faults.py``) and the cluster they strike (``cluster.py``)."""
