"""Replay: rebuild state and re-execute decisions from the log alone.

Pure cores (``points``, ``state``, ``ledger``, ``verify``, ``whatif``) and one port with three
adapters (``log``: Kafka, a file export, memory); ``engine`` wires them for the CLI
(``cli.replay_app``) and the admin API.
"""
