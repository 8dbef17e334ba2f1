"""Generated protobuf/gRPC stubs (see proto/generate.py)."""
