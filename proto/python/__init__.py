"""The contracts between pdserve's processes, as Python: the gRPC APIs' generated stubs
(``*_pb2``, from proto/pdserve/v1/ by ``generate.py``), sampling parameters to and from
protobuf (``params``), the workers' shared vocabulary (``workers``) and the Redis key schema
(``redis_keys``). Nothing here imports torch.
"""
