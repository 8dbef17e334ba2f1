"""The router's client-facing edge: gRPC and OpenAI-compatible HTTP servers, formats, errors."""
