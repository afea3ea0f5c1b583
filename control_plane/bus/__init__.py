"""The event log: topic catalog (pure), sequence tracking (pure) and Kafka adapters."""
