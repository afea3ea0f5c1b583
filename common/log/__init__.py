"""The event log: topic catalog (pure), sequence tracking (pure), the ``LogReader`` protocol and
its memory/file/Kafka implementations, snapshot I/O, and the Kafka producer/consumer adapters."""
