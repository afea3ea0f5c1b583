"""Audit: the pure projection of events into admin-store rows, its SQL store and its consumer."""
