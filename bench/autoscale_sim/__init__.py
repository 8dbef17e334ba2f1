"""A simulator of pdserve at scale: the real planner (``pdserve.cluster.autoscale``) and
the real routing policy (``pdserve.router.policies``) over a cost model of this machine's
workers, hundreds of them, on request traces; autoscaling policies compared side by side.

``python -m pdserve.bench.autoscale_sim --help``; results in docs/benchmarks.md ("Autoscaling at
scale"). Modules: ``model`` (cost model, profiles), ``traces``, ``workers``, ``cluster``
(lifecycle, routing heaps), ``router``, ``flow`` (a request's events), ``engine`` (the event loop,
autoscaling), ``metrics``, ``baselines`` (the autoscalers), ``oracle`` (a reference), ``runner``,
``distserve`` (disaggregated vs colocated goodput), ``calibration`` (the model against the
measurement), ``decision_cost``, ``report``, ``plots``, ``cli``.
"""
