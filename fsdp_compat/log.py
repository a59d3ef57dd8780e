"""fsdp-compat's logger, one home for every room: the ``fsdp_compat`` logger with its ``fsdp-compat:`` prefix and a
stderr handler that steps aside once the application configures logging. A low module (imports the standard
library and :mod:`fsdp_compat.switches` only), so the planner, the run-time layer and the adapters log the same way
whichever of them loads first."""

from __future__ import annotations

import logging
import sys
import threading

from fsdp_compat import switches

__all__ = ["PREFIX", "announce_once", "announced", "logger", "reset_announcement"]

PREFIX = switches.PREFIX
logger = logging.getLogger("fsdp_compat")


class _Prefix(logging.Filter):
    """Puts ``fsdp-compat:`` into the message itself, so any handler's format (verl's, Ray's) shows the package;
    ``FSDP_COMPAT_LOG=quiet`` drops INFO and below (read at emit time)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(PREFIX):
            record.msg = f"{PREFIX} {record.msg}"
        return record.levelno >= logging.WARNING or switches.log_level() != "quiet"


class _DefaultStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Shows fsdp-compat records on stderr while the application configured no logging of its own.

    Once the root logger has handlers, records only propagate to them: nothing is printed twice, and an
    application's own configuration (level, format, destination) wins.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if logger.propagate and logging.getLogger().handlers:
            return
        self.stream = sys.stderr  # the current stderr (pytest, Ray and notebooks swap it)
        super().emit(record)


def _setup_logger() -> None:
    if not any(isinstance(h, _DefaultStderrHandler) for h in logger.handlers):
        handler = _DefaultStderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s [%(levelname)s, pid %(process)d]"))
        logger.addHandler(handler)
    if not any(isinstance(f, _Prefix) for f in logger.filters):
        logger.addFilter(_Prefix())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


_setup_logger()

# ------------------------------------------------------------------------------------------ the one INFO line

_announcement: list[tuple[str, tuple[object, ...]]] = []  # this process's INFO line, once it was logged
_announcement_lock = threading.Lock()


def announce_once(message: str, *args: object) -> bool:
    """Log what fsdp-compat changed that the job now uses, as this process's one INFO line.

    The first call in a process logs ``message % args`` at INFO (``fsdp-compat: patched ...``; dropped under
    ``FSDP_COMPAT_LOG=quiet``) and returns True; every later call logs at DEBUG only and returns False, so a process
    prints at most one such line, however many adapters and FSDP2 roots it has. Callers announce when their change
    is first *used* (an adapter's replacement is first called, the generic layer installs its run-time layer on a
    root), never when a module is merely imported. Thread-safe; never raises (logging reports a bad format)."""
    with _announcement_lock:
        first = not _announcement
        if first:
            _announcement.append((message, args))
    logger.log(logging.INFO if first else logging.DEBUG, message, *args)
    return first


def announced() -> str | None:
    """This process's INFO line (without the prefix), or None while nothing was announced."""
    with _announcement_lock:
        if not _announcement:
            return None
        message, args = _announcement[0]
    return message % args if args else message


def reset_announcement() -> None:
    """Forget the announcement (tests that check the line in one process, one after another)."""
    with _announcement_lock:
        _announcement.clear()
