"""Who may say what on the log: event signatures by owner. Pure (stdlib ``hmac``).

Kafka's ACLs say which principal may write which *topic*; they cannot say which *key*. Every
worker writes ``kv`` and ``workers``, so with ACLs alone a process holding the worker
credential could register, drain or fill the index as any other worker, and the router's own
principal, which records the config it was started with on ``admin``, could issue itself a
router API key. Signatures close both:

* every event of a guarded stream names its **owner**, the one identity whose key must sign
  it (:func:`signers_of`):

  ============ ============================== ============================================
  stream       owner                          so that
  ============ ============================== ============================================
  ``kv``       ``worker:<envelope key>``      a worker speaks only for its own blocks
  ``workers``  ``worker:<envelope key>``      ... and its own registration, load, drain
  ``admin``    ``role:admin``                 only the admin API issues keys, pins pools;
               (``RouterConfigChanged``: or   a router may record only its own config
               ``role:router``)
  ``requests`` ``role:router``; a worker's    the planner and the metrics count only what a
               handoff facts: ``worker:<its   router saw (a worker cannot invent arrivals or
               id>`` (``PrefillCompleted``    completions); a worker speaks only for its own
               also ``role:router``)          prefill and the transfers it pulled
  ============ ============================== ============================================

  and the envelope key of a worker event must be the payload's ``worker_id`` (the key a
  signature covers is the worker the event is about); a request event is keyed by its request,
  so its worker owner is the payload's worker (:data:`ABOUT_FIELD`: ``worker_id`` of a
  ``PrefillCompleted``, ``dst_worker``, the puller, of a ``KvTransfer*``);
* an owner's key is ``HMAC-SHA256(master, "switchyard-event-owner\\0" + owner)``: the holder
  of the master (the operator's stack, and the components that verify) can derive every key,
  a process given one owner's key (:class:`Signer` of one identity) can sign only as that owner;
* the signature is a last envelope field, ``"sig": bin(32)`` = HMAC-SHA256(owner key, the
  envelope's bytes without it). Appending it to the encoded map is one byte changed in the
  map header and 38 bytes added; verifying re-derives the unsigned bytes the same way, so
  nothing is re-encoded. Readers that do not verify ignore the field (msgspec and the native
  decoder skip unknown fields), so the wire format stays version 1.

:class:`Verifier` raises :class:`ForgedEvent` (a :class:`~schemas.errors.SchemaError`, so every
fold dead-letters it with its reason and goes on) for an event of a guarded stream that is
unsigned, signed by a key that is not its owner's, or whose key is not its worker. What it
does not stop: a holder of a worker's own key may re-send a copy of a record that worker
signed (the bytes verify); sequence numbers make such a copy a duplicate on its partition.

Snapshots (``common/log/snapshots.py``) are not envelopes but the same owner keys sign them:
the owner is named by the snapshot key's prefix (:data:`SNAPSHOT_OWNERS`: a router view is the
routers', a load view the planner's, a metrics projection the processor's), and the record is
``SYSNAP1\\0`` + HMAC-SHA256(owner key, ``"switchyard-snapshot\\0" + key + "\\0" + bytes``) +
the view's bytes (:meth:`Signer.sign_snapshot`, :meth:`Verifier.open_snapshot`). So a planner
or processor credential can no longer write a router snapshot the routers restore.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

import msgspec

from schemas.errors import SchemaError
from schemas.events import ALL_EVENT_TYPES, RouterConfigChanged

#: The stack secret every owner key derives from (``secrets_dir/event-signing``).
MASTER_SECRET = "event-signing"
ADMIN = "role:admin"
ROUTER = "role:router"

_CONTEXT = b"switchyard-event-owner\x00"
_FIELD = b"\xa3sig\xc4\x20"  # fixstr "sig", then bin8 of 32 bytes
_TRAILER = len(_FIELD) + 32
_STREAM_OF: dict[str, str] = {cls.TYPE: cls.STREAM for cls in ALL_EVENT_TYPES}
GUARDED_STREAMS = ("kv", "workers", "admin", "requests")
#: Request events a worker writes, and the payload field naming the worker that must sign them.
ABOUT_FIELD: dict[str, str] = {"PrefillCompleted": "worker_id", "KvTransferStarted": "dst_worker",
                               "KvTransferCompleted": "dst_worker", "KvTransferFailed": "dst_worker"}
#: Of those, the ones a router writes too (aggregated serving records the prefill it saw).
_ROUTER_TOO = frozenset({"PrefillCompleted"})


#: A snapshot key's prefix (before its first ``:``) and the one identity that signs it.
SNAPSHOT_OWNERS: dict[str, str] = {"router-view": ROUTER, "load-view": "role:planner", "metrics": "role:processor"}
_SNAP_MAGIC = b"SYSNAP1\x00"
_SNAP_CONTEXT = b"switchyard-snapshot\x00"
_SNAP_HEAD = len(_SNAP_MAGIC) + 32


class ForgedEvent(SchemaError):
    """An event of a guarded stream its owner did not sign. ``reason`` is ``forged:<why>``:
    ``unsigned``, ``bad_signature`` or ``key_not_worker``."""

    def __init__(self, why: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = f"forged:{why}"


def worker_owner(worker_id: str) -> str:
    return f"worker:{worker_id}"


def owner_key(master: bytes, owner: str) -> bytes:
    return hmac.new(master, _CONTEXT + owner.encode(), hashlib.sha256).digest()


def about_of(payload) -> str | None:
    """The worker a request event's signature speaks for (:data:`ABOUT_FIELD`), else None."""
    f = ABOUT_FIELD.get(getattr(payload, "TYPE", ""))
    return None if f is None else getattr(payload, f, None)


def signers_of(type_name: str, key: str, about: str | None = None) -> tuple[str, ...]:
    """The identities whose signature an event of this type and envelope key needs (one of
    them); () for an event of a stream that is not guarded. ``about``: a request event's worker
    (:func:`about_of`)."""
    stream = _STREAM_OF.get(type_name)
    if stream in ("kv", "workers"):
        return (worker_owner(key),)
    if stream == "admin":
        return (ADMIN, ROUTER) if type_name == RouterConfigChanged.TYPE else (ADMIN,)
    if stream == "requests":
        if type_name not in ABOUT_FIELD:
            return (ROUTER,)
        worker = () if not about else (worker_owner(about),)
        return (*worker, ROUTER) if type_name in _ROUTER_TOO else worker or (ROUTER,)
    return ()


def _mac(key: bytes, unsigned: bytes) -> bytes:
    return hmac.new(key, unsigned, hashlib.sha256).digest()


def snapshot_owner(key: str) -> str | None:
    """The identity whose key signs the snapshot stored under ``key`` (None: no one's)."""
    return SNAPSHOT_OWNERS.get(key.split(":", 1)[0])


def _snapshot_mac(owner_key_: bytes, key: str, data) -> bytes:
    h = hmac.new(owner_key_, _SNAP_CONTEXT + key.encode() + b"\x00", hashlib.sha256)
    h.update(data)  # no copy of a view's tens of MB
    return h.digest()


def snapshot_data(value: bytes) -> bytes:
    """A stored snapshot's view bytes, its signature dropped unchecked: only for a process that
    cannot verify (:meth:`common.settings.BusSettings.verifier` is None)."""
    return value[_SNAP_HEAD:] if value[:len(_SNAP_MAGIC)] == _SNAP_MAGIC else value


class Signer:
    """Signs encoded envelopes: as any owner (holding the master) or as one identity only."""

    def __init__(self, key_of: Callable[[str], bytes | None], who: str) -> None:
        self._key_of = key_of
        self.who = who

    @classmethod
    def master(cls, master: bytes) -> Signer:
        keys: dict[str, bytes] = {}

        def key_of(owner: str) -> bytes:
            k = keys.get(owner)
            if k is None:
                k = keys[owner] = owner_key(master, owner)
            return k

        return cls(key_of, "any owner (the master)")

    @classmethod
    def identity(cls, owner: str, key: bytes) -> Signer:
        return cls(lambda o: key if o == owner else None, owner)

    def key_for(self, type_name: str, key: str, about: str | None = None) -> bytes | None:
        """The key to sign this event with; None when its stream is not guarded. Raises
        ``PermissionError`` when this signer may not sign it. (The router's native producer
        signs with it: ``native/src/emit.rs``.)"""
        owners = signers_of(type_name, key, about)
        if not owners:
            return None
        for owner in owners:
            k = self._key_of(owner)
            if k is not None:
                return k
        raise PermissionError(f"{type_name} for {key!r} must be signed by {' or '.join(owners)}; "
                              f"this process signs as {self.who}")

    def check(self, type_name: str, key: str, about: str | None = None) -> None:
        """Raises ``PermissionError`` when this signer may not sign such an event."""
        self.key_for(type_name, key, about)

    def seal(self, value: bytes) -> bytes:
        """``value`` signed with this signer's one identity's key whatever the event says: what a
        hand-rolled client holding that key could write (``switchyard security-check`` and the
        tests send it; the verifier must refuse it unless the identity owns the event)."""
        k = self._key_of(self.who)
        if k is None:
            raise ValueError("seal needs a signer of one identity")
        return _signed(value, _mac(k, value))

    def sign_snapshot(self, key: str, data: bytes) -> bytes:
        """The record to store a view's snapshot ``data`` under ``key`` (module docstring).
        Raises ``PermissionError`` when this signer is not the key's owner."""
        owner = snapshot_owner(key)
        k = None if owner is None else self._key_of(owner)
        if k is None:
            raise PermissionError(f"snapshot {key!r} must be signed by {owner or 'a known owner'} "
                                  f"(keys: {', '.join(f'{p}:*' for p in SNAPSHOT_OWNERS)}); this process "
                                  f"signs as {self.who}")
        return _SNAP_MAGIC + _snapshot_mac(k, key, data) + data

    def seal_snapshot(self, key: str, data: bytes) -> bytes:
        """A snapshot record signed with this signer's one identity's key whoever owns ``key``
        (what :meth:`seal` is for events: the forgery the probes and tests send)."""
        k = self._key_of(self.who)
        if k is None:
            raise ValueError("seal_snapshot needs a signer of one identity")
        return _SNAP_MAGIC + _snapshot_mac(k, key, data) + data

    def sign(self, type_name: str, key: str, value: bytes, about: str | None = None) -> bytes:
        """``value`` (an encoded envelope) with its signature, or as it is when its stream is
        not guarded. Raises ``PermissionError`` when this signer may not sign it."""
        k = self.key_for(type_name, key, about)
        return value if k is None else _signed(value, _mac(k, value))


def _signed(value: bytes, tag: bytes) -> bytes:
    head = value[0]
    if not 0x80 <= head < 0x8F:  # a fixmap with room for one more field
        raise ValueError(f"not an envelope map (first byte {head:#x})")
    return bytes((head + 1,)) + value[1:] + _FIELD + tag


class _ProbeData(msgspec.Struct):
    #: Any value: a request event's worker field that is not a string names no worker (the
    #: codec refuses the payload after the signature check).
    worker_id: object = None
    dst_worker: object = None


class _Probe(msgspec.Struct):
    type: str
    key: str
    #: Any value: a ``sig`` that is not bytes is a bad signature, not a record the probe cannot
    #: read (which would pass it on unverified).
    sig: object = None
    data: _ProbeData | None = None


_probe = msgspec.msgpack.Decoder(_Probe).decode


class Verifier:
    """Checks that every event of a guarded stream is signed by its owner (module docstring)."""

    def __init__(self, master: bytes) -> None:
        self._keys: dict[str, bytes] = {}
        self._master = master
        self._native = None

    def native(self):
        """This check in the native core (``switchyard_native.NativeVerifier``), built once: it
        accepts a ``kv`` record only when this class would, and leaves every other record to
        :meth:`check` (the batch folds, ``NativePrefixIndex.apply_run``, use it)."""
        if self._native is None:
            import switchyard_native

            self._native = switchyard_native.NativeVerifier(self._master)
        return self._native

    def _key(self, owner: str) -> bytes:
        k = self._keys.get(owner)
        if k is None:
            if len(self._keys) > 100_000:
                self._keys.clear()
            k = self._keys[owner] = owner_key(self._master, owner)
        return k

    def check(self, value: bytes) -> None:
        """Raises :class:`ForgedEvent`, or nothing. Bytes that are not an envelope pass: the
        codec then refuses them with its own reason."""
        try:
            p = _probe(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        field = ABOUT_FIELD.get(p.type)
        about = getattr(p.data, field, None) if field is not None and p.data is not None else None
        owners = signers_of(p.type, p.key, about if isinstance(about, str) else None)
        if not owners:
            return
        if p.sig is None:
            raise ForgedEvent("unsigned", f"{p.type} for {p.key[:100]!r} is not signed (needs {owners[0]})")
        if _STREAM_OF[p.type] in ("kv", "workers"):
            wid = p.data.worker_id if p.data is not None else None
            if wid != p.key:
                raise ForgedEvent("key_not_worker", f"{p.type} keyed {p.key[:100]!r} is about worker "
                                  f"{str(wid)[:100]!r}: a worker's events carry its own id as their key")
        if not isinstance(p.sig, bytes) or value[-_TRAILER:-32] != _FIELD or len(p.sig) != 32:
            raise ForgedEvent("bad_signature", f"{p.type} for {p.key[:100]!r}: the signature is not the "
                              "envelope's last field")
        unsigned = bytes((value[0] - 1,)) + value[1:-_TRAILER]
        tag = value[-32:]
        for owner in owners:
            if hmac.compare_digest(_mac(self._key(owner), unsigned), tag):
                return
        raise ForgedEvent("bad_signature", f"{p.type} for {p.key[:100]!r} is not signed by "
                          f"{' or '.join(owners)}")

    def open_snapshot(self, key: str, value: bytes) -> bytes:
        """The view bytes of a snapshot record stored under ``key``, once its owner's signature
        checks; else raises :class:`ForgedEvent` (``forged:unsigned``, ``forged:bad_signature``,
        ``forged:no_owner``)."""
        owner = snapshot_owner(key)
        if owner is None:
            raise ForgedEvent("no_owner", f"snapshot {key[:100]!r}: no role owns such a key")
        if value[:len(_SNAP_MAGIC)] != _SNAP_MAGIC or len(value) < _SNAP_HEAD:
            raise ForgedEvent("unsigned", f"snapshot {key[:100]!r} is not signed (needs {owner})")
        data = memoryview(value)[_SNAP_HEAD:]
        if not hmac.compare_digest(_snapshot_mac(self._key(owner), key, data), value[len(_SNAP_MAGIC):_SNAP_HEAD]):
            raise ForgedEvent("bad_signature", f"snapshot {key[:100]!r} is not signed by {owner}")
        return bytes(data)
