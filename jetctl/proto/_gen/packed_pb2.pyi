from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PackedCall(_message.Message):
    __slots__ = ("prompt_ids", "completion_ids", "completion_logprobs")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[bytes]
    completion_ids: _containers.RepeatedScalarFieldContainer[bytes]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, prompt_ids: _Optional[_Iterable[bytes]] = ..., completion_ids: _Optional[_Iterable[bytes]] = ..., completion_logprobs: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PackedTrajectory(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[PackedCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[PackedCall, _Mapping]]] = ...) -> None: ...

class PackedGroup(_message.Message):
    __slots__ = ("trajectories",)
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[PackedTrajectory]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[PackedTrajectory, _Mapping]]] = ...) -> None: ...

class PackedSubmitRequest(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[PackedGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[PackedGroup, _Mapping]]] = ...) -> None: ...
