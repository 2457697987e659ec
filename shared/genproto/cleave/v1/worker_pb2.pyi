from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "pooling", "normalize", "use_beam_search", "best_of", "length_penalty", "early_stopping", "constraint")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: TokenIdList
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIdList]
    prompt_logprobs: int
    pooling: str
    normalize: bool
    use_beam_search: bool
    best_of: int
    length_penalty: float
    early_stopping: str
    constraint: OutputConstraint
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Union[TokenIdList, _Mapping]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIdList, _Mapping]]] = ..., prompt_logprobs: _Optional[int] = ..., pooling: _Optional[str] = ..., normalize: _Optional[bool] = ..., use_beam_search: _Optional[bool] = ..., best_of: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[str] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ...) -> None: ...

class TokenIdList(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenOutput(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("protocol_version", "request_id", "worker_id", "prefill_worker_addr", "transfer_backend", "block_ids", "num_tokens", "lease_deadline_unix", "compat_hash", "kv_peer_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ADDR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    request_id: str
    worker_id: str
    prefill_worker_addr: str
    transfer_backend: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_deadline_unix: float
    compat_hash: str
    kv_peer_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., prefill_worker_addr: _Optional[str] = ..., transfer_backend: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_deadline_unix: _Optional[float] = ..., compat_hash: _Optional[str] = ..., kv_peer_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "kv_handle", "num_prompt_tokens", "num_cached_tokens", "finish_reason", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: TokenOutput
    kv_handle: KVHandle
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenOutput]
    def __init__(self, first_token: _Optional[_Union[TokenOutput, _Mapping]] = ..., kv_handle: _Optional[_Union[KVHandle, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenOutput, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "first_token", "kv_handle", "generated_token_ids", "announce_admission")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    first_token: TokenOutput
    kv_handle: KVHandle
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    announce_admission: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., first_token: _Optional[_Union[TokenOutput, _Mapping]] = ..., kv_handle: _Optional[_Union[KVHandle, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., announce_admission: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "kv_transfer_bytes", "kv_transfer_seconds", "kv_recomputed", "prompt_logprobs", "embedding", "sample_index")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenOutput]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_transfer_bytes: int
    kv_transfer_seconds: float
    kv_recomputed: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenOutput]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    sample_index: int
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenOutput, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., kv_recomputed: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenOutput, _Mapping]]] = ..., embedding: _Optional[_Iterable[float]] = ..., sample_index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "sample_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_only: bool
    def __init__(self, request_id: _Optional[str] = ..., sample_only: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KVMetadataRequest(_message.Message):
    __slots__ = ("protocol_version", "compat_hash")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    compat_hash: str
    def __init__(self, protocol_version: _Optional[int] = ..., compat_hash: _Optional[str] = ...) -> None: ...

class KVMetadataResponse(_message.Message):
    __slots__ = ("protocol_version", "compat_hash", "transfer_backend", "metadata")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    compat_hash: str
    transfer_backend: str
    metadata: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., compat_hash: _Optional[str] = ..., transfer_backend: _Optional[str] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "role", "model", "worker_id", "max_model_len", "generate_many")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    GENERATE_MANY_FIELD_NUMBER: _ClassVar[int]
    status: str
    role: str
    model: str
    worker_id: str
    max_model_len: int
    generate_many: bool
    def __init__(self, status: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., worker_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., generate_many: _Optional[bool] = ...) -> None: ...

class LoadStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadStatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "kv_cache_usage", "num_leased_requests", "transfer_backend", "kv_transfer_bytes_total", "kv_transfer_count", "kv_transfer_failures", "kv_ownership_error", "num_held_blocks")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_COUNT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_OWNERSHIP_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_leased_requests: int
    transfer_backend: str
    kv_transfer_bytes_total: int
    kv_transfer_count: int
    kv_transfer_failures: int
    kv_ownership_error: str
    num_held_blocks: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_leased_requests: _Optional[int] = ..., transfer_backend: _Optional[str] = ..., kv_transfer_bytes_total: _Optional[int] = ..., kv_transfer_count: _Optional[int] = ..., kv_transfer_failures: _Optional[int] = ..., kv_ownership_error: _Optional[str] = ..., num_held_blocks: _Optional[int] = ...) -> None: ...

class ListCachedBlocksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCachedBlocksResponse(_message.Message):
    __slots__ = ("block_hashes", "event_seq", "block_size")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    event_seq: int
    block_size: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., event_seq: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class GenerateCall(_message.Message):
    __slots__ = ("call_id", "request", "metadata", "cancel")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request: GenerateRequest
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    cancel: bool
    def __init__(self, call_id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class GenerateCallEvent(_message.Message):
    __slots__ = ("call_id", "response", "ended", "status_code", "status_details")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: GenerateResponse
    ended: bool
    status_code: int
    status_details: str
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., ended: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class GenerateEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[GenerateCallEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[GenerateCallEvent, _Mapping]]] = ...) -> None: ...
