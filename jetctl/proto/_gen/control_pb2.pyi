from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("name", "kind", "task", "model", "state", "pid", "container_id", "restarts", "endpoint", "revision", "json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    task: str
    model: str
    state: str
    pid: int
    container_id: str
    restarts: int
    endpoint: str
    revision: str
    json: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., task: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., container_id: _Optional[str] = ..., restarts: _Optional[int] = ..., endpoint: _Optional[str] = ..., revision: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...

class RunStatusReply(_message.Message):
    __slots__ = ("run", "run_dir", "uptime_s", "nodes", "state", "rows_json")
    class RowsJsonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROWS_JSON_FIELD_NUMBER: _ClassVar[int]
    run: str
    run_dir: str
    uptime_s: float
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    state: str
    rows_json: _containers.ScalarMap[str, str]
    def __init__(self, run: _Optional[str] = ..., run_dir: _Optional[str] = ..., uptime_s: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., state: _Optional[str] = ..., rows_json: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DownRequest(_message.Message):
    __slots__ = ("grace_s",)
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    def __init__(self, grace_s: _Optional[float] = ...) -> None: ...

class DownReply(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class SwapRequest(_message.Message):
    __slots__ = ("task", "image", "agent", "grace_s", "drop_old")
    TASK_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    DROP_OLD_FIELD_NUMBER: _ClassVar[int]
    task: str
    image: str
    agent: str
    grace_s: float
    drop_old: bool
    def __init__(self, task: _Optional[str] = ..., image: _Optional[str] = ..., agent: _Optional[str] = ..., grace_s: _Optional[float] = ..., drop_old: _Optional[bool] = ...) -> None: ...

class SwapReply(_message.Message):
    __slots__ = ("ok", "message", "revision")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    revision: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("task", "clients")
    TASK_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    task: str
    clients: int
    def __init__(self, task: _Optional[str] = ..., clients: _Optional[int] = ...) -> None: ...

class ScaleReply(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("kind", "task", "model", "name", "revision", "host", "index")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    kind: str
    task: str
    model: str
    name: str
    revision: str
    host: str
    index: int
    def __init__(self, kind: _Optional[str] = ..., task: _Optional[str] = ..., model: _Optional[str] = ..., name: _Optional[str] = ..., revision: _Optional[str] = ..., host: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("name", "run", "revision", "index", "agent", "task_json", "model_json", "tls_mode", "servers", "refused_revisions", "recipe_json", "deterministic", "ship_logs")
    class ServersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_JSON_FIELD_NUMBER: _ClassVar[int]
    TLS_MODE_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REVISIONS_FIELD_NUMBER: _ClassVar[int]
    RECIPE_JSON_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    SHIP_LOGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    run: str
    revision: str
    index: int
    agent: str
    task_json: str
    model_json: str
    tls_mode: str
    servers: _containers.ScalarMap[str, str]
    refused_revisions: _containers.RepeatedScalarFieldContainer[str]
    recipe_json: str
    deterministic: bool
    ship_logs: bool
    def __init__(self, name: _Optional[str] = ..., run: _Optional[str] = ..., revision: _Optional[str] = ..., index: _Optional[int] = ..., agent: _Optional[str] = ..., task_json: _Optional[str] = ..., model_json: _Optional[str] = ..., tls_mode: _Optional[str] = ..., servers: _Optional[_Mapping[str, str]] = ..., refused_revisions: _Optional[_Iterable[str]] = ..., recipe_json: _Optional[str] = ..., deterministic: _Optional[bool] = ..., ship_logs: _Optional[bool] = ...) -> None: ...

class LedgerRecord(_message.Message):
    __slots__ = ("seq", "table", "op", "key", "data")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    seq: int
    table: str
    op: str
    key: str
    data: str
    def __init__(self, seq: _Optional[int] = ..., table: _Optional[str] = ..., op: _Optional[str] = ..., key: _Optional[str] = ..., data: _Optional[str] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("name", "kind", "task", "model", "revision", "status_json", "journal", "records", "endpoint", "metrics", "refused_revisions", "final", "host", "log_lines")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REVISIONS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOG_LINES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    task: str
    model: str
    revision: str
    status_json: str
    journal: str
    records: _containers.RepeatedCompositeFieldContainer[LedgerRecord]
    endpoint: str
    metrics: str
    refused_revisions: _containers.RepeatedScalarFieldContainer[str]
    final: bool
    host: str
    log_lines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., task: _Optional[str] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., status_json: _Optional[str] = ..., journal: _Optional[str] = ..., records: _Optional[_Iterable[_Union[LedgerRecord, _Mapping]]] = ..., endpoint: _Optional[str] = ..., metrics: _Optional[str] = ..., refused_revisions: _Optional[_Iterable[str]] = ..., final: _Optional[bool] = ..., host: _Optional[str] = ..., log_lines: _Optional[_Iterable[str]] = ...) -> None: ...

class SyncReply(_message.Message):
    __slots__ = ("servers", "refused_revisions", "drain", "journal_seq", "message", "known", "revoked_nodes")
    class ServersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REVISIONS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_SEQ_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    REVOKED_NODES_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.ScalarMap[str, str]
    refused_revisions: _containers.RepeatedScalarFieldContainer[str]
    drain: bool
    journal_seq: int
    message: str
    known: bool
    revoked_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, servers: _Optional[_Mapping[str, str]] = ..., refused_revisions: _Optional[_Iterable[str]] = ..., drain: _Optional[bool] = ..., journal_seq: _Optional[int] = ..., message: _Optional[str] = ..., known: _Optional[bool] = ..., revoked_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class RowPosition(_message.Message):
    __slots__ = ("epoch", "index")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    index: int
    def __init__(self, epoch: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class RowsRequest(_message.Message):
    __slots__ = ("name", "task", "n_rows", "epochs", "want", "acked", "released", "fresh")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    N_ROWS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    name: str
    task: str
    n_rows: int
    epochs: int
    want: int
    acked: _containers.RepeatedCompositeFieldContainer[RowPosition]
    released: _containers.RepeatedCompositeFieldContainer[RowPosition]
    fresh: bool
    def __init__(self, name: _Optional[str] = ..., task: _Optional[str] = ..., n_rows: _Optional[int] = ..., epochs: _Optional[int] = ..., want: _Optional[int] = ..., acked: _Optional[_Iterable[_Union[RowPosition, _Mapping]]] = ..., released: _Optional[_Iterable[_Union[RowPosition, _Mapping]]] = ..., fresh: _Optional[bool] = ...) -> None: ...

class RowsReply(_message.Message):
    __slots__ = ("rows", "exhausted")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[RowPosition]
    exhausted: bool
    def __init__(self, rows: _Optional[_Iterable[_Union[RowPosition, _Mapping]]] = ..., exhausted: _Optional[bool] = ...) -> None: ...
