"""Stored events as JSON: the msgspec transcoder the JetStream factory gives applications, and
the fast decoder every fold of the log reads events with."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
from eventsourcing.persistence import (
    DatetimeAsISO,
    DecimalAsStr,
    Transcoder,
    Transcoding,
    TranscodingNotRegisteredError,
    UUIDAsHex,
    find_id_convertor,
    pass_through_convertor,
)

# exact types msgspec writes as themselves; anything else (subclasses included) needs a transcoding,
# so a MyStr or a tuple comes back as what went in rather than as a plain str / list
_NATIVE_SCALARS: frozenset[type] = frozenset({str, int, float, bool, type(None)})
_CONTAINERS: frozenset[type] = frozenset({list, dict})
from eventsourcing.utils import resolve_topic


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


class EventDecoder:
    """`mapper.to_domain_event`, faster for the usual stored event: the same steps (topic,
    state, id conversion, upcasting, the event object), except the transcoder's walk over the
    whole decoded state. That walk only rebuilds `{"_type_", "_data_"}` objects; when the
    stored JSON holds exactly one, as the event's timestamp, that one is decoded by the same
    registered transcoding and the rest is left as msgspec decoded it, which is what the walk
    would give. Anything else (a cipher or compressor, another transcoder, more transcoded
    values) goes through the mapper itself."""

    _MARK = b'"_type_"'

    def __init__(self, mapper: Any) -> None:
        self.mapper = mapper
        names = getattr(mapper.transcoder, "names", None)
        self.fast = (not getattr(mapper, "cipher", None) and not getattr(mapper, "compressor", None)
                     and isinstance(names, dict))
        self.names: dict[str, Any] = names if isinstance(names, dict) else {}
        self.decode_json = msgspec.json.Decoder().decode
        self.classes: dict[str, tuple[type, type, Any, int]] = {}
        self._stamp_decoders: dict[str, Any] = {}

    def __call__(self, n: Any) -> Any:
        state = n.state
        if type(state) is not bytes or not self.fast or state.count(self._MARK) != 1:
            return self.mapper.to_domain_event(n)
        try:
            event_state = self.decode_json(state)
        except msgspec.DecodeError:
            return self.mapper.to_domain_event(n)  # let the mapper say what is wrong
        stamp = event_state.get("timestamp") if type(event_state) is dict else None
        if type(stamp) is not dict or len(stamp) != 2:
            return self.mapper.to_domain_event(n)
        name = stamp.get("_type_")
        decode_stamp = self._stamp_decoders.get(name) if type(name) is str else None
        if decode_stamp is None:
            decode_stamp = self._stamp_decoder(name)
        data = stamp.get("_data_")
        if decode_stamp is None or type(data) is not str:
            # (the one built-in transcoding, datetime_iso, takes only a string: the mapper
            # raises as it would have)
            return self.mapper.to_domain_event(n)
        event_state["timestamp"] = decode_stamp(data)
        oid = n.originator_id
        got = self.classes.get(n.topic)
        if got is None or got[0] is not type(oid):
            got = self._event_class(n.topic, oid)
        _, cls, id_convertor, class_version = got
        event_state["originator_id"] = oid if id_convertor is None else id_convertor(oid)
        event_state["originator_version"] = n.originator_version
        from_version = event_state.pop("class_version", 1)
        while from_version < class_version:
            getattr(cls, f"upcast_v{from_version}_v{from_version + 1}")(event_state)
            from_version += 1
        event: Any = object.__new__(cls)
        object.__setattr__(event, "__dict__", event_state)
        return event

    def _stamp_decoder(self, name: Any) -> Any:
        """The registered transcoding's decode for `name` (None: not one): the library's
        DatetimeAsISO's is `datetime.fromisoformat` behind an isinstance assert, called
        directly (the caller passes strings only)."""
        got = self._stamp_decoders.get(name) if type(name) is str else None
        if got is None and type(name) is str:
            transcoding = self.names.get(name)
            if transcoding is None or type(transcoding) is dict:
                return None
            if type(transcoding) is DatetimeAsISO:
                got = datetime.fromisoformat
            else:
                got = transcoding.decode
            self._stamp_decoders[name] = got
        return got

    def _event_class(self, topic: str, oid: Any) -> tuple[type, type, Any, int]:
        """(the originator id's type, the event class, its id convertor unless pass-through,
        its class version) for `topic`, kept for the id type last seen with it."""
        cls = resolve_topic(topic)
        convertor = find_id_convertor(cls, type(oid))  # type: ignore[arg-type]
        got = self.classes[topic] = (
            type(oid), cls, None if convertor is pass_through_convertor else convertor,
            getattr(cls, "class_version", 1))
        return got
