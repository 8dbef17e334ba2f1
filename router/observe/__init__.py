"""What the router shows: Prometheus metrics, SLO goodput, the ops dashboard."""
