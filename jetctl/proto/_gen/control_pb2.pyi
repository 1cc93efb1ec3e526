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
    __slots__ = ("run", "run_dir", "uptime_s", "nodes", "state")
    RUN_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    run: str
    run_dir: str
    uptime_s: float
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    state: str
    def __init__(self, run: _Optional[str] = ..., run_dir: _Optional[str] = ..., uptime_s: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., state: _Optional[str] = ...) -> None: ...

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
