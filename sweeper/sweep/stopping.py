"""A stop asked for by a signal (SIGTERM, Ctrl-C), kept until the sweep has acted on it.

The CLI's signal handler raises its exception (Terminated, KeyboardInterrupt) where the
main thread happens to be. Python drops an exception raised inside a finalizer or a
garbage-collector callback ("Exception ignored in: ...", seen with SQLAlchemy's event
registry), and the handler ignores repeated signals, so such a stop was lost: the sweep ran
on to its end. The handler also records the stop here, and the controller's loop raises it
again at its next turn (at most ~0.5 s later) when it has not arrived.
"""

from __future__ import annotations

_requested: list[BaseException] = []


def request(err: BaseException) -> None:
    if not _requested:
        _requested.append(err)


def clear() -> None:
    _requested.clear()


def raise_if_requested() -> None:
    """Raise the recorded stop (a fresh exception of its type) if there is one."""
    if _requested:
        raise type(_requested[0])()
