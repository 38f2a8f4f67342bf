"""models/hook_lock.py: prefills on two threads hook one model at once (a serial batch's engine thread and its
prefill thread both prefill at the tail); a trace waits for both and keeps new hooks out while it runs."""

from __future__ import annotations

import threading

import torch

from vpsd.models.hook_lock import hooks_installed, tracing


def test_hook_holders_share_the_model_and_a_trace_has_it_alone():
    model = torch.nn.Linear(2, 2)
    a_in, b_in, release, traced = (threading.Event() for _ in range(4))
    order: list[str] = []

    def hold(entered: threading.Event) -> None:
        with hooks_installed(model, lambda: [model.register_forward_hook(lambda *args: None)]):
            entered.set()
            release.wait(30)
        order.append("hooks off")

    a = threading.Thread(target=hold, args=(a_in,))
    b = threading.Thread(target=hold, args=(b_in,))
    a.start()
    assert a_in.wait(30)
    b.start()
    assert b_in.wait(30)  # a second holder enters while the first holds: shared
    assert len(model._forward_hooks) == 2

    def trace() -> None:
        with tracing(model):
            order.append(f"traced with {len(model._forward_hooks)} hooks")
            traced.set()

    t = threading.Thread(target=trace)
    t.start()
    assert not traced.wait(0.5)  # it waits for both holders
    release.set()
    for th in (a, b, t):
        th.join(30)
    assert order == ["hooks off", "hooks off", "traced with 0 hooks"]
