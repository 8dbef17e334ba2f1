"""One request's life on the router: lifecycle, dispatch to workers, failover and fan-out."""
