"""The worker process core both roles share: server, host, metrics, edge checks, errors."""
