"""Code both planes share: what both planes import, and which imports neither.

:mod:`schemas` (the event contract) is its other half. Here: vLLM-compatible block hashing
(:mod:`.hashing`), the tokenizer the router and the workers share (:mod:`.tokenizer`), the
process settings for the log (:mod:`.settings`), and the log itself (:mod:`.log`): topic
catalog, Kafka producer/consumer adapters, sequence tracking, the ``LogReader`` protocol with
its memory, file and Kafka implementations, snapshots, and the one positioned fold.
"""
