"""The msgspec-based JSON transcoder that the JetStream factory gives applications.

Owns the mapping of non-JSON types (and subclasses of JSON types) to `{"_type_", "_data_"}` objects.
"""

from __future__ import annotations

from typing import Any

import msgspec
from eventsourcing.persistence import (
    DatetimeAsISO,
    DecimalAsStr,
    Transcoder,
    Transcoding,
    TranscodingNotRegisteredError,
    UUIDAsHex,
)

# exact types msgspec writes as themselves; anything else (subclasses included) needs a transcoding,
# so a MyStr or a tuple comes back as what went in rather than as a plain str / list
_NATIVE_SCALARS: frozenset[type] = frozenset({str, int, float, bool, type(None)})
_CONTAINERS: frozenset[type] = frozenset({list, dict})


class TupleAsList(Transcoding):
    type = tuple
    name = "tuple_as_list"

    def encode(self, obj: tuple[Any, ...]) -> list[Any]:
        return list(obj)

    def decode(self, data: list[Any]) -> tuple[Any, ...]:
        return tuple(data)


class MsgspecTranscoder(Transcoder):
    """JSON via msgspec, wire-compatible with eventsourcing's JSONTranscoder output."""

    def __init__(self) -> None:
        self.types: dict[type, Transcoding] = {}
        self.names: dict[str, Transcoding] = {}
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder()
        self.register(TupleAsList())
        # the library registers these three on every application; registering here too keeps a
        # transcoder built standalone (tests, tools) able to read what applications wrote
        self.register(UUIDAsHex())
        self.register(DecimalAsStr())
        self.register(DatetimeAsISO())

    def register(self, transcoding: Transcoding) -> None:
        self.types[transcoding.type] = transcoding
        self.names[transcoding.name] = transcoding

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(self._to_plain(obj))

    def decode(self, data: bytes) -> Any:
        return self._from_plain(self._decoder.decode(data))

    def _to_plain(self, obj: Any) -> Any:
        t = type(obj)
        if t in _NATIVE_SCALARS:
            return obj
        if t is dict:
            # scalars inline: most values of an event's state are, and a call per value
            # was most of this walk's cost
            native, plain = _NATIVE_SCALARS, self._to_plain
            return {k: v if type(v) in native else plain(v) for k, v in obj.items()}
        if t is list:
            native, plain = _NATIVE_SCALARS, self._to_plain
            return [v if type(v) in native else plain(v) for v in obj]
        transcoding = self.types.get(t)
        if transcoding is None:
            msg = (
                f"Object of type {t} is not serializable. Please define and register "
                "a custom transcoding for this type."
            )
            raise TranscodingNotRegisteredError(msg)
        # the transcoding's output may itself hold custom types (CustomType2 -> CustomType1)
        return {"_type_": transcoding.name, "_data_": self._to_plain(transcoding.encode(obj))}

    def _from_plain(self, obj: Any) -> Any:
        t = type(obj)
        if t is list:
            plain = self._from_plain
            return [plain(v) if type(v) in _CONTAINERS else v for v in obj]
        if t is not dict:
            return obj
        if len(obj) == 2 and "_type_" in obj and "_data_" in obj:
            name = obj["_type_"]
            transcoding = self.names.get(name) if isinstance(name, str) else None
            if transcoding is None:
                msg = (
                    f"Data serialized with name '{name}' is not deserializable. "
                    "Please register a custom transcoding for this type."
                )
                raise TranscodingNotRegisteredError(msg)
            # inner first: a transcoding's decode receives already-decoded values
            return transcoding.decode(self._from_plain(obj["_data_"]))
        # decoded JSON: only a list or an object can hold anything to transcode
        plain = self._from_plain
        return {k: plain(v) if type(v) in _CONTAINERS else v for k, v in obj.items()}
