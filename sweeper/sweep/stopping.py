"""A stop asked for by a signal (SIGTERM, Ctrl-C), kept until the sweep has acted on it.

The CLI's signal handler raises its exception (Terminated, KeyboardInterrupt) where the
main thread happens to be. Python drops an exception raised inside a finalizer or a
garbage-collector callback ("Exception ignored in: ...", seen with SQLAlchemy's event
registry), and the handler ignores repeated signals, so such a stop was lost: the sweep ran
on to its end. The handler also records the stop here, and the controller's loop raises it
again at its next turn (at most ~0.5 s later) when it has not arrived.
"""

from __future__ import annotations

import contextlib

_requested: list[BaseException] = []
_held: list[bool] = []


class Terminated(KeyboardInterrupt):
    """SIGTERM: a command stops as on Ctrl-C (a sweep records its in-flight trials
    `interrupted`, run again by --resume; `sweeper serve` keeps what completed); the command
    exits 143 (128 + 15), as a process killed by it would."""


def signal_name(err: BaseException) -> str:
    """SIGTERM or SIGINT: which signal the stop `err` (or the one recorded first: Ray may
    raise it again as a plain KeyboardInterrupt) came from."""
    first = _requested[0] if _requested else err
    return "SIGTERM" if isinstance(first, Terminated) or isinstance(err, Terminated) else "SIGINT"


def request(err: BaseException) -> None:
    if not _requested:
        _requested.append(err)


def clear() -> None:
    _requested.clear()


def requested() -> BaseException | None:
    """The stop a signal asked for, or None."""
    return _requested[0] if _requested else None


@contextlib.contextmanager
def held():
    """Inside the block the CLI's handler records a stop without raising it, so that what
    the block does (`sweeper serve` closing its workers, logging and printing a stream it
    has served) is done whole; the caller then acts on `requested()`."""
    _held.append(True)
    try:
        yield
    finally:
        _held.pop()


def holding() -> bool:
    return bool(_held)


def raise_if_requested() -> None:
    """Raise the recorded stop (a fresh exception of its type) if there is one."""
    if _requested:
        raise type(_requested[0])()
