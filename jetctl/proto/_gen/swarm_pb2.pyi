from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LLMCall(_message.Message):
    __slots__ = ("model", "prompt_ids", "completion_ids", "completion_logprobs", "model_version", "finish_reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    model_version: int
    finish_reason: str
    def __init__(self, model: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., model_version: _Optional[int] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("id", "group_id", "task", "task_id", "client_id", "client_revision", "role", "calls", "reward", "status", "error", "timings", "metadata", "costs")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CostsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REVISION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    group_id: str
    task: str
    task_id: str
    client_id: str
    client_revision: str
    role: str
    calls: _containers.RepeatedCompositeFieldContainer[LLMCall]
    reward: float
    status: str
    error: str
    timings: _containers.ScalarMap[str, float]
    metadata: _containers.ScalarMap[str, str]
    costs: _containers.ScalarMap[str, float]
    def __init__(self, id: _Optional[str] = ..., group_id: _Optional[str] = ..., task: _Optional[str] = ..., task_id: _Optional[str] = ..., client_id: _Optional[str] = ..., client_revision: _Optional[str] = ..., role: _Optional[str] = ..., calls: _Optional[_Iterable[_Union[LLMCall, _Mapping]]] = ..., reward: _Optional[float] = ..., status: _Optional[str] = ..., error: _Optional[str] = ..., timings: _Optional[_Mapping[str, float]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., costs: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("id", "task", "task_id", "model", "trajectories")
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    id: str
    task: str
    task_id: str
    model: str
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, id: _Optional[str] = ..., task: _Optional[str] = ..., task_id: _Optional[str] = ..., model: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("client_id", "task", "client_revision", "model")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REVISION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    task: str
    client_revision: str
    model: str
    def __init__(self, client_id: _Optional[str] = ..., task: _Optional[str] = ..., client_revision: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("model", "model_source", "model_version", "max_staleness", "max_message_bytes", "max_context_tokens", "tokenizer_files", "chat_template", "eos_token_ids", "min_client_revision_rank", "refused_revisions")
    class TokenizerFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_CLIENT_REVISION_RANK_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REVISIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_source: str
    model_version: int
    max_staleness: int
    max_message_bytes: int
    max_context_tokens: int
    tokenizer_files: _containers.ScalarMap[str, bytes]
    chat_template: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_client_revision_rank: int
    refused_revisions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., model_source: _Optional[str] = ..., model_version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., tokenizer_files: _Optional[_Mapping[str, bytes]] = ..., chat_template: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., min_client_revision_rank: _Optional[int] = ..., refused_revisions: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt_ids", "max_tokens", "temperature", "top_p", "stop_token_ids", "request_id", "seed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    seed: int
    def __init__(self, model: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("completion_ids", "completion_logprobs", "model_version", "finish_reason", "load")
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    model_version: int
    finish_reason: str
    load: Load
    def __init__(self, completion_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., model_version: _Optional[int] = ..., finish_reason: _Optional[str] = ..., load: _Optional[_Union[Load, _Mapping]] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("engine_rows", "engine_max_rows", "engine_queued", "buffer_groups", "groups_per_step")
    ENGINE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_QUEUED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    engine_rows: int
    engine_max_rows: int
    engine_queued: int
    buffer_groups: int
    groups_per_step: int
    def __init__(self, engine_rows: _Optional[int] = ..., engine_max_rows: _Optional[int] = ..., engine_queued: _Optional[int] = ..., buffer_groups: _Optional[int] = ..., groups_per_step: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("group_id", "code", "reason")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[Ack.Code]
        ACCEPTED: _ClassVar[Ack.Code]
        DUPLICATE: _ClassVar[Ack.Code]
        STALE: _ClassVar[Ack.Code]
        INVALID: _ClassVar[Ack.Code]
        REVISION: _ClassVar[Ack.Code]
        BUSY: _ClassVar[Ack.Code]
    CODE_UNSPECIFIED: Ack.Code
    ACCEPTED: Ack.Code
    DUPLICATE: Ack.Code
    STALE: Ack.Code
    INVALID: Ack.Code
    REVISION: Ack.Code
    BUSY: Ack.Code
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    code: Ack.Code
    reason: str
    def __init__(self, group_id: _Optional[str] = ..., code: _Optional[_Union[Ack.Code, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("acks", "model_version")
    ACKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[Ack]
    model_version: int
    def __init__(self, acks: _Optional[_Iterable[_Union[Ack, _Mapping]]] = ..., model_version: _Optional[int] = ...) -> None: ...

class PullWeightsRequest(_message.Message):
    __slots__ = ("have_version",)
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    have_version: int
    def __init__(self, have_version: _Optional[int] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("version", "format", "kind", "total_bytes", "offset", "data", "sha256", "adapter_config_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    format: str
    kind: str
    total_bytes: int
    offset: int
    data: bytes
    sha256: str
    adapter_config_json: str
    def __init__(self, version: _Optional[int] = ..., format: _Optional[str] = ..., kind: _Optional[str] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ..., adapter_config_json: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("model", "model_source", "model_version", "buffer_groups", "accepted_groups", "accepted_trajectories", "rejected", "trained_trajectories", "trained_groups", "reward_mean_recent", "trajectories_per_second", "tokens_generated", "last_checkpoint_version", "uptime_s", "refused_calls", "last_step", "pid", "received_by_task", "rejected_groups", "reward_by_task", "no_signal_recent", "signal", "skipped_groups", "batch_share_by_task", "backfilled_by_task", "starving_tasks", "staleness_by_task", "no_signal_by_task", "signal_by_task")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusedCallsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LastStepEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ReceivedByTaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RejectedGroupsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RewardByTaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class BatchShareByTaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class BackfilledByTaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StalenessByTaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class NoSignalByTaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class SignalByTaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_RECENT_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CALLS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BY_TASK_FIELD_NUMBER: _ClassVar[int]
    REJECTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REWARD_BY_TASK_FIELD_NUMBER: _ClassVar[int]
    NO_SIGNAL_RECENT_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SHARE_BY_TASK_FIELD_NUMBER: _ClassVar[int]
    BACKFILLED_BY_TASK_FIELD_NUMBER: _ClassVar[int]
    STARVING_TASKS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_BY_TASK_FIELD_NUMBER: _ClassVar[int]
    NO_SIGNAL_BY_TASK_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_BY_TASK_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_source: str
    model_version: int
    buffer_groups: int
    accepted_groups: int
    accepted_trajectories: int
    rejected: _containers.ScalarMap[str, int]
    trained_trajectories: int
    trained_groups: int
    reward_mean_recent: float
    trajectories_per_second: float
    tokens_generated: int
    last_checkpoint_version: int
    uptime_s: float
    refused_calls: _containers.ScalarMap[str, int]
    last_step: _containers.ScalarMap[str, float]
    pid: int
    received_by_task: _containers.ScalarMap[str, int]
    rejected_groups: _containers.ScalarMap[str, int]
    reward_by_task: _containers.ScalarMap[str, float]
    no_signal_recent: float
    signal: str
    skipped_groups: int
    batch_share_by_task: _containers.ScalarMap[str, float]
    backfilled_by_task: _containers.ScalarMap[str, int]
    starving_tasks: _containers.RepeatedScalarFieldContainer[str]
    staleness_by_task: _containers.ScalarMap[str, float]
    no_signal_by_task: _containers.ScalarMap[str, float]
    signal_by_task: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., model_source: _Optional[str] = ..., model_version: _Optional[int] = ..., buffer_groups: _Optional[int] = ..., accepted_groups: _Optional[int] = ..., accepted_trajectories: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., trained_trajectories: _Optional[int] = ..., trained_groups: _Optional[int] = ..., reward_mean_recent: _Optional[float] = ..., trajectories_per_second: _Optional[float] = ..., tokens_generated: _Optional[int] = ..., last_checkpoint_version: _Optional[int] = ..., uptime_s: _Optional[float] = ..., refused_calls: _Optional[_Mapping[str, int]] = ..., last_step: _Optional[_Mapping[str, float]] = ..., pid: _Optional[int] = ..., received_by_task: _Optional[_Mapping[str, int]] = ..., rejected_groups: _Optional[_Mapping[str, int]] = ..., reward_by_task: _Optional[_Mapping[str, float]] = ..., no_signal_recent: _Optional[float] = ..., signal: _Optional[str] = ..., skipped_groups: _Optional[int] = ..., batch_share_by_task: _Optional[_Mapping[str, float]] = ..., backfilled_by_task: _Optional[_Mapping[str, int]] = ..., starving_tasks: _Optional[_Iterable[str]] = ..., staleness_by_task: _Optional[_Mapping[str, float]] = ..., no_signal_by_task: _Optional[_Mapping[str, float]] = ..., signal_by_task: _Optional[_Mapping[str, str]] = ...) -> None: ...
