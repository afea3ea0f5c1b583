"""Errors raised while decoding events. One base so adapters can dead-letter any of them."""


class SchemaError(Exception):
    """An event could not be decoded into a known payload. ``reason`` names the kind."""

    reason = "schema_error"


class MalformedEvent(SchemaError):
    """The bytes are not a valid envelope, or the payload fails its schema."""

    reason = "malformed"


class UnknownEventType(SchemaError):
    """The envelope names an event type this reader has never heard of."""

    reason = "unknown_type"


class UnsupportedSchemaVersion(SchemaError):
    """The event's schema version is newer than this reader knows, or has no upcaster."""

    reason = "unsupported_version"
