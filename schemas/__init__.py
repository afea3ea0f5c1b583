"""Switchyard's event contract: payload types, envelope, codec, upcasters and JSON Schemas.

This package is pure (no I/O besides reading its own schema files) and is the single source of
event definitions for the control plane, the data plane and the tools.
"""

from schemas.envelope import Envelope, EnvelopeFactory, EventCodec, new_event_id
from schemas.errors import MalformedEvent, SchemaError, UnknownEventType, UnsupportedSchemaVersion

__all__ = [
    "Envelope",
    "EnvelopeFactory",
    "EventCodec",
    "MalformedEvent",
    "SchemaError",
    "UnknownEventType",
    "UnsupportedSchemaVersion",
    "new_event_id",
]
