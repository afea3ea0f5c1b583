"""The envelope every event travels in, and its wire codec (MessagePack via msgspec).

Wire layout: one MessagePack map per Kafka record value::

    {"id": str, "type": str, "v": int, "key": str, "producer": str, "epoch": int, "seq": int,
     "at": int (unix ns), "corr": str?, "cause": str?, "data": {payload}}

A payload type's ``KEY_FIELD`` (a request event's ``request_id``, from v2) is the key: it is not
written in ``data``, nor as ``corr``, and decoding fills both in from ``key``.

The payload is decoded lazily (``msgspec.Raw``) so that routing on type and version, and
dead-lettering an unknown one, never pays for a full decode.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec
import msgspec.inspect as mi

from schemas.errors import MalformedEvent, UnknownEventType, UnsupportedSchemaVersion
from schemas.events import ALL_EVENT_TYPES, Event
from schemas.signing import Verifier
from schemas.types import MAX_WORKER_ID_LEN, WORKER_ID_FIELDS
from schemas.upcasters import UPCASTERS

E = TypeVar("E", bound=Event)

#: Version of the envelope layout itself.
ENVELOPE_VERSION = 1


class _Head(msgspec.Struct, frozen=True, kw_only=True):
    """The envelope's metadata fields (wire names in ``name=``), shared by the typed envelope
    and the raw one the codec decodes first."""

    event_id: str = msgspec.field(name="id")
    type: str
    version: int = msgspec.field(name="v")
    key: str
    producer: str
    epoch: int
    seq: int
    occurred_at_ns: int = msgspec.field(name="at")
    correlation_id: str | None = msgspec.field(name="corr", default=None)
    causation_id: str | None = msgspec.field(name="cause", default=None)


class Envelope(_Head, Generic[E], frozen=True, kw_only=True, omit_defaults=True):
    """Metadata common to every event, plus the payload.

    ``(producer, epoch, seq)`` identifies an event for deduplication: a producer numbers the
    events it sends on each stream from 0 within one incarnation (epoch). A restarted producer
    takes a higher epoch; consumers then reset their expectation for it.
    """

    data: E


class _RawEnvelope(_Head, frozen=True, kw_only=True):
    data: msgspec.Raw


def new_event_id() -> str:
    """128 random bits as hex: unique without coordination."""
    return os.urandom(16).hex()


class EventCodec:
    """Encodes envelopes and decodes them to the newest known payload version.

    Decoding an older version validates it against its own struct, then applies the upcasters
    one version step at a time. A type it does not know, or a version newer than the newest it
    knows, raises a :class:`schemas.errors.SchemaError` subclass with a message that says which.
    So does a payload naming a worker id longer than :data:`~schemas.types.MAX_WORKER_ID_LEN`,
    or holding a NaN or an infinity in a float field (msgpack can carry them; no duration, cost
    or rate is one, and one would poison every sum and histogram it reaches).
    """

    def __init__(self, types: tuple[type[Event], ...] = ALL_EVENT_TYPES, *,
                 verifier: Verifier | None = None) -> None:
        #: Checks each event's owner signed it (schemas/signing.py) before it is decoded; None:
        #: not checked (in-memory folds of logs a test wrote).
        self.verifier = verifier
        self._by_key: dict[tuple[str, int], type[Event]] = {}
        self._latest: dict[str, int] = {}
        for cls in types:
            k = (cls.TYPE, cls.VERSION)
            if k in self._by_key:
                raise ValueError(f"duplicate registration of {cls.TYPE} v{cls.VERSION}")
            self._by_key[k] = cls
            self._latest[cls.TYPE] = max(self._latest.get(cls.TYPE, 0), cls.VERSION)
        self._payload_decoders = {
            k: msgspec.msgpack.Decoder(cls) for k, cls in self._by_key.items()
        }
        #: Payload type -> its worker id fields (only types that have some).
        self._worker_fields = {
            cls: fields for cls in types
            if (fields := tuple(f for f in cls.__struct_fields__ if f in WORKER_ID_FIELDS))
        }
        #: Payload type -> the function that finds a non-finite float in it (types with floats).
        self._float_checks = {cls: check for cls in types if (check := _float_check_of(cls))}
        self._raw_decoder = msgspec.msgpack.Decoder(_RawEnvelope)
        self._encoder = msgspec.msgpack.Encoder()

    # -- registry -------------------------------------------------------------------------

    def latest_version(self, type_name: str) -> int:
        try:
            return self._latest[type_name]
        except KeyError:
            raise UnknownEventType(f"unknown event type {type_name!r}") from None

    def payload_type(self, type_name: str, version: int) -> type[Event]:
        return self._by_key[(type_name, version)]

    def known(self) -> dict[tuple[str, int], type[Event]]:
        return dict(self._by_key)

    # -- encode ---------------------------------------------------------------------------

    def encode(self, env: Envelope[Event]) -> bytes:
        """The envelope's bytes. A payload with a ``KEY_FIELD`` (a request event from v2) is
        written without it, and without ``corr`` when that is the key too: the key says it once.
        Raises ``ValueError`` when the field is not the key (it could not be read back)."""
        return self._encoder.encode(self._as_written(env))

    def encode_payload(self, env: Envelope[Event]) -> tuple[bytes, str | None]:
        """The payload's bytes as :meth:`encode` writes them in the envelope, and the ``corr``
        it writes (None: left out): for a writer of the envelope itself, the router's native
        producer (``native/src/emit.rs``, whose bytes a test holds equal to :meth:`encode`'s)."""
        w = self._as_written(env)
        return self._encoder.encode(w.data), w.correlation_id

    @staticmethod
    def _as_written(env: Envelope[Event]) -> Envelope[Event]:
        """``env`` as it is written: the key field rule of :meth:`encode`."""
        field = env.data.KEY_FIELD
        if field is not None:
            own = getattr(env.data, field)
            if own != env.key:
                raise ValueError(f"{env.type} v{env.version}: {field} {own!r} is not the envelope's key {env.key!r}")
            # Copies (the caller's envelope is left as it is) with the field blanked, which
            # ``omit_defaults`` leaves out: a third of ``msgspec.structs.replace``'s cost.
            data = env.data.__copy__()
            _set(data, field, "")
            same = env.correlation_id == env.key
            env = env.__copy__()
            _set(env, "data", data)
            if same:
                _set(env, "correlation_id", None)
        return env

    # -- decode ---------------------------------------------------------------------------

    def peek(self, buf: bytes) -> _RawEnvelope:
        """Decode the envelope only; the payload stays raw bytes."""
        try:
            return self._raw_decoder.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MalformedEvent(f"not a Switchyard envelope: {e}") from None

    def check_owner(self, buf: bytes) -> None:
        """Raises :class:`~schemas.signing.ForgedEvent` for an event its owner did not sign
        (when this codec has a verifier); the decoders call it first."""
        if self.verifier is not None:
            self.verifier.check(buf)

    def decode(self, buf: bytes) -> Envelope[Event]:
        if self.verifier is not None:
            self.verifier.check(buf)
        raw = self.peek(buf)
        latest = self._latest.get(raw.type)
        if latest is None:
            raise UnknownEventType(
                f"unknown event type {raw.type!r} (v{raw.version}) from producer {raw.producer!r}"
            )
        if raw.version > latest:
            raise UnsupportedSchemaVersion(
                f"{raw.type} v{raw.version} is newer than this reader knows (v{latest}); "
                "upgrade the consumer"
            )
        decoder = self._payload_decoders.get((raw.type, raw.version))
        if decoder is None:
            raise UnsupportedSchemaVersion(
                f"{raw.type} v{raw.version} is not a registered version (latest v{latest})"
            )
        try:
            payload: Event = decoder.decode(raw.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MalformedEvent(f"{raw.type} v{raw.version} payload invalid: {e}") from None
        if raw.version < latest:
            payload = self._upcast(payload, raw.version, latest)
        corr = raw.correlation_id
        if payload.KEY_FIELD is not None:  # on the wire once, as the key (``encode``)
            fill_key_field(payload, raw.key, raw.version)
            if corr is None:
                corr = raw.key
        for name in self._worker_fields.get(type(payload), ()):
            wid = getattr(payload, name)
            if wid is not None and len(wid) > MAX_WORKER_ID_LEN:
                raise MalformedEvent(f"{raw.type} v{raw.version} {name} of {len(wid)} characters "
                                     f"(at most {MAX_WORKER_ID_LEN})")
        check = self._float_checks.get(type(payload))
        if check is not None and (raw.version < latest or _NON_FINITE.search(raw.data) is not None) \
                and (where := check(payload)):
            raise MalformedEvent(f"{raw.type} v{raw.version} {where} is not a finite number")
        return Envelope(
            event_id=raw.event_id,
            type=raw.type,
            version=latest,
            key=raw.key,
            producer=raw.producer,
            epoch=raw.epoch,
            seq=raw.seq,
            occurred_at_ns=raw.occurred_at_ns,
            correlation_id=corr,
            causation_id=raw.causation_id,
            data=payload,
        )

    def _upcast(self, payload: Event, version: int, latest: int) -> Event:
        doc = msgspec.to_builtins(payload)
        name = payload.TYPE
        for v in range(version, latest):
            step = UPCASTERS.get((name, v))
            if step is None:
                raise UnsupportedSchemaVersion(f"no upcaster for {name} v{v} -> v{v + 1}")
            doc = step(doc)
        try:
            return msgspec.convert(doc, self._by_key[(name, latest)])
        except msgspec.ValidationError as e:
            raise MalformedEvent(f"{name} upcast v{version}->v{latest} invalid: {e}") from None


_FloatCheck = Callable[[object], str | None]
_set = msgspec.structs.force_setattr


def fill_key_field(payload: Event, key: str, version: int | None = None) -> None:
    """Set a decoded payload's ``KEY_FIELD`` from its envelope ``key`` (the bytes leave it out);
    raises ``MalformedEvent`` when the payload names another value than the key."""
    field = payload.KEY_FIELD
    if field is None:
        return
    own = getattr(payload, field)
    if not own:
        _set(payload, field, key)
    elif own != key:
        raise MalformedEvent(f"{payload.TYPE} v{payload.VERSION if version is None else version} {field} "
                             f"{own[:200]!r} is not its key {key[:200]!r}")

#: A msgpack float64 (0xcb) or float32 (0xca) with every exponent bit set: a NaN or an infinity
#: (either sign). Payload bytes without this pattern hold no non-finite float, so ``decode``
#: skips the walk of the payload's float fields (0.6-1.2 us an event); bytes with it (a real
#: one, or the same bytes by chance inside a string or an integer) are walked, as is an upcast.
_NON_FINITE = re.compile(rb"\xcb[\x7f\xff][\xf0-\xff]|\xca[\x7f\xff][\x80-\xff]")


@functools.cache
def _float_check_of(cls: type) -> _FloatCheck | None:
    """:func:`_float_check` of a payload type, built once per process (a type's fields do not
    change; building them took most of a codec's 17 ms construction)."""
    return _float_check(mi.type_info(cls))


def _float_check(t: mi.Type) -> _FloatCheck | None:
    """A function returning the path of the first NaN or infinity in a value of type ``t``
    (None when all are finite), or None when ``t`` cannot hold a float: floats as such, in
    optional fields, in nested structs and in lists of them (free-form dicts are not walked)."""
    if isinstance(t, mi.FloatType):
        return lambda v: None if math.isfinite(v) else "value"
    if isinstance(t, mi.UnionType):
        checks = [c for c in map(_float_check, t.types) if c]
        if not checks:
            return None

        def first(v: object) -> str | None:
            if v is None or isinstance(v, (str, int, bytes)):
                return None
            for c in checks:  # a float, a struct or a list: only the matching member finds one
                try:
                    w = c(v)
                except (TypeError, AttributeError):
                    continue
                if w is not None:
                    return w
            return None

        return first
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType)) and hasattr(t, "item_type"):
        inner = _float_check(t.item_type)
        if inner is None:
            return None
        return lambda v: next((f"[{i}].{w}" for i, x in enumerate(v) if (w := inner(x)) is not None), None)
    if isinstance(t, mi.StructType):
        fields = [(f.name, c) for f in t.fields if (c := _float_check(f.type))]
        if not fields:
            return None

        def check(v: object) -> str | None:
            for name, c in fields:
                x = getattr(v, name)
                if x is not None and (w := c(x)) is not None:
                    return name if w == "value" else f"{name}{w if w.startswith('[') else '.' + w}"
            return None

        return check
    return None


class EnvelopeFactory:
    """Stamps payloads with envelope metadata for one producer incarnation.

    Sequence numbers are kept per *scope*: an ordered substream. The Kafka producer uses
    ``"<topic>:<partition>"`` (it picks partitions itself), because only within one partition is
    a consumer guaranteed to see a producer's events in order, so only there can a dense
    sequence tell a real gap from events that went elsewhere. Without a scope, the stream name.
    """

    def __init__(self, producer: str, epoch: int, clock_ns) -> None:  # clock_ns: () -> int
        self.producer = producer
        self.epoch = epoch
        self._clock_ns = clock_ns
        self._seq: dict[str, int] = {}
        self._last_ns = 0

    def _stamp(self) -> int:
        """The clock, made strictly increasing: one incarnation's events, whatever partitions
        they went to, are totally ordered by ``occurred_at_ns`` (a fold of a producer's own
        events, such as the router's ledger, merges its partitions by it)."""
        now = self._clock_ns()
        if now <= self._last_ns:
            now = self._last_ns + 1
        self._last_ns = now
        return now

    def next_seq(self, scope: str) -> int:
        return self._seq.get(scope, 0)

    def wrap(
        self,
        payload: E,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        key: str | None = None,
        scope: str | None = None,
    ) -> Envelope[E]:
        scope = scope or payload.STREAM
        seq = self._seq.get(scope, 0)
        self._seq[scope] = seq + 1
        return Envelope(
            event_id=new_event_id(),
            type=payload.TYPE,
            version=payload.VERSION,
            key=key if key is not None else payload.key(),
            producer=self.producer,
            epoch=self.epoch,
            seq=seq,
            occurred_at_ns=self._stamp(),
            correlation_id=correlation_id,
            causation_id=causation_id,
            data=payload,
        )
