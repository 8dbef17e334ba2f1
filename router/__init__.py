"""The router: client-facing gRPC and OpenAI-compatible HTTP servers in front of the workers.

Start one with ``pdserve.router.service.start_router``; see router/README.md for the layout.
Importing this package is cheap: it pulls in neither torch, ray nor redis.
"""
