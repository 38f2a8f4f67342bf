"""Forward hooks on a model several threads share, and dynamo's traces of that model: never at once.

A prefill on a spare core (engine/prefill_ahead.py) measures its pruning signals with forward hooks on the shared
language model (models/signals.py, and the UV-Prune rows of engine/prefix_cache.py; `this_thread_only` keeps the
other threads' forwards out of them) while the engine's thread may trace a captured step of the same model
(models/captured.py: a shape's first call). Dynamo inlines the hooks it finds at trace time and guards on them, so
a hook the other thread removed between the trace and the creation of its guards failed the step (IndexError in
dynamo's CLOSURE_MATCH; the CPU dry run of the GPU check hit it at B = 2 with capture "trace"), and a trace that
did see a hook would keep a guard on it, tracing again whenever hooks came and went.

So hooks are installed under their model's lock and held there until they are removed (`hooks_installed`), and a
captured step takes the same lock for a call that traces (`tracing`). No trace sees a hook: none is inlined or
guarded on (dynamo's `skip_nnmodule_hook_guards`, on by default, leaves hooks out of the guards of a trace made
without them), and a hook installed after a trace never runs in it, as `this_thread_only` would have it anyway.
The lock is shared among hook holders (two prefills on two threads hook the same model at once, each its own
hooks: a serial batch's engine thread and its prefill thread both prefill at the tail) and exclusive for a trace.
Only a trace waits, and what waits for it: a captured step's later calls (the graph's replays) take no lock.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Iterator

import torch


class SharedLock:
    """Shared by any number of holders at once (`shared`), or held by one alone (`exclusive`), which waits for the
    shared holders to leave and keeps new ones out meanwhile. Not reentrant across the two: a thread that holds it
    shared and asks for it exclusive waits forever (a hooked prefill never traces: its forward is eager)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, SharedLock]" = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def model_lock(language_model: torch.nn.Module) -> SharedLock:
    """The lock of `language_model`'s hooks and traces (one per model, created on first use)."""
    with _GUARD:
        lock = _LOCKS.get(language_model)
        if lock is None:
            lock = _LOCKS[language_model] = SharedLock()
        return lock


@contextlib.contextmanager
def hooks_installed(language_model: torch.nn.Module, install: Callable[[], list]) -> Iterator[list]:
    """`install()`'s hook handles on `language_model` (or its submodules), removed on exit, with the model's lock
    held shared throughout: no trace of the model runs while they are in place."""
    with model_lock(language_model).shared():
        handles = install()
        try:
            yield handles
        finally:
            for handle in handles:
                handle.remove()


@contextlib.contextmanager
def tracing(language_model: torch.nn.Module) -> Iterator[None]:
    """Held around a call that may trace `language_model` (a captured step's first call of a shape): no hook is
    on the model meanwhile."""
    with model_lock(language_model).exclusive():
        yield
