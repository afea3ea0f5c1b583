"""Errors of the shared code (common/). One base, so an adapter can catch (and dead-letter or report)
any of them; contexts that catch their own base catch these by name where they can occur."""

from __future__ import annotations


class KernelError(Exception):
    """Base of every error raised by ``common``."""

    reason = "kernel_error"


class HashConfigError(KernelError, ValueError):
    """A hashing configuration that cannot reproduce the engines' hashes."""

    reason = "hash_config"


class LogReadError(KernelError):
    """The log cannot be read as asked (missing topic, timeout, not an export file)."""

    reason = "log_read"
