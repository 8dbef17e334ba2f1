from pdserve.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("worker_id", "backend", "agent_metadata", "block_ids", "num_present_blocks", "transfer_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    backend: str
    agent_metadata: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_present_blocks: int
    transfer_id: str
    def __init__(self, worker_id: _Optional[str] = ..., backend: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_present_blocks: _Optional[int] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "destination", "peer_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    PEER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    destination: KVDestination
    peer_prefix: PeerPrefix
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., peer_prefix: _Optional[_Union[PeerPrefix, _Mapping]] = ...) -> None: ...

class PeerPrefix(_message.Message):
    __slots__ = ("worker_id", "address", "num_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    num_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    destination: KVDestination
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "transfer")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    first_token: _common_pb2.TokenChunk
    transfer: TransferReport
    def __init__(self, first_token: _Optional[_Union[_common_pb2.TokenChunk, _Mapping]] = ..., transfer: _Optional[_Union[TransferReport, _Mapping]] = ...) -> None: ...

class TransferReport(_message.Message):
    __slots__ = ("ok", "error", "bytes", "seconds", "blocks_sent", "blocks_skipped", "since_first_token_s")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    bytes: int
    seconds: float
    blocks_sent: int
    blocks_skipped: int
    since_first_token_s: float
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., blocks_sent: _Optional[int] = ..., blocks_skipped: _Optional[int] = ..., since_first_token_s: _Optional[float] = ...) -> None: ...

class ReserveKVRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveKVResponse(_message.Message):
    __slots__ = ("accepted", "destination")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    destination: KVDestination
    def __init__(self, accepted: _Optional[bool] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "first_token", "transfer_timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    first_token: _common_pb2.TokenChunk
    transfer_timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token: _Optional[_Union[_common_pb2.TokenChunk, _Mapping]] = ..., transfer_timeout_s: _Optional[float] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "waiting", "running", "free_blocks", "cached_blocks", "total_blocks", "prefix_hit_tokens", "prompt_tokens", "generated_tokens", "transfer_bytes", "transfers_ok", "transfers_failed", "recompute_fallbacks", "epoch", "transfers_in_flight", "spec_verify_steps", "spec_proposed_tokens", "spec_accepted_tokens", "spec_branch_accepted_tokens", "spec_acceptance_length_counts", "host_tier", "disk_tier", "disk_tier_stopped", "peer_fetches", "peer_fetched_blocks", "peer_fetched_bytes", "peer_served_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_OK_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_BRANCH_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_LENGTH_COUNTS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    DISK_TIER_FIELD_NUMBER: _ClassVar[int]
    DISK_TIER_STOPPED_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHES_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_SERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    waiting: int
    running: int
    free_blocks: int
    cached_blocks: int
    total_blocks: int
    prefix_hit_tokens: int
    prompt_tokens: int
    generated_tokens: int
    transfer_bytes: int
    transfers_ok: int
    transfers_failed: int
    recompute_fallbacks: int
    epoch: int
    transfers_in_flight: int
    spec_verify_steps: int
    spec_proposed_tokens: int
    spec_accepted_tokens: int
    spec_branch_accepted_tokens: int
    spec_acceptance_length_counts: _containers.RepeatedScalarFieldContainer[int]
    host_tier: KVTierStats
    disk_tier: KVTierStats
    disk_tier_stopped: bool
    peer_fetches: int
    peer_fetched_blocks: int
    peer_fetched_bytes: int
    peer_served_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfers_ok: _Optional[int] = ..., transfers_failed: _Optional[int] = ..., recompute_fallbacks: _Optional[int] = ..., epoch: _Optional[int] = ..., transfers_in_flight: _Optional[int] = ..., spec_verify_steps: _Optional[int] = ..., spec_proposed_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_branch_accepted_tokens: _Optional[int] = ..., spec_acceptance_length_counts: _Optional[_Iterable[int]] = ..., host_tier: _Optional[_Union[KVTierStats, _Mapping]] = ..., disk_tier: _Optional[_Union[KVTierStats, _Mapping]] = ..., disk_tier_stopped: _Optional[bool] = ..., peer_fetches: _Optional[int] = ..., peer_fetched_blocks: _Optional[int] = ..., peer_fetched_bytes: _Optional[int] = ..., peer_served_blocks: _Optional[int] = ...) -> None: ...

class KVTierStats(_message.Message):
    __slots__ = ("hit_tokens", "stored_blocks", "bytes_in", "bytes_out", "used_bytes")
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    hit_tokens: int
    stored_blocks: int
    bytes_in: int
    bytes_out: int
    used_bytes: int
    def __init__(self, hit_tokens: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...
