"""Replay: rebuild state and re-execute decisions from the log alone.

Pure cores (``points``, ``state``, ``verify``, ``whatif``, the ``oracle`` fold; the routers'
ledgers are :mod:`control_plane.router.ledger`) read through one port,
:class:`common.log.reader.LogReader`, with three adapters (Kafka, a file export, memory);
``engine`` wires them for the CLI (``cli.replay_app``) and the admin API.
"""
