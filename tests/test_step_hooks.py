"""The probe's step-boundary hooks (agent/hooks/step_hooks.py): their order at a boundary, the
failure rule, the rule for who takes the step, and nothing on the hot path while none is registered."""

from __future__ import annotations

import threading

from torchtop.agent.hooks.probe import Probe
from torchtop.agent.hooks.step_hooks import MAX_FAILURES, RULE, Claim, Order, Phase


def _probe() -> Probe:
    return Probe(thread_id=threading.get_ident())


def test_hooks_run_at_each_boundary_in_their_order_and_only_while_registered() -> None:
    probe = _probe()
    hooks = probe.hooks
    assert probe.on_step is None  # the boundary's one test: nothing registered, nothing run
    ran: list[str] = []
    hooks.register("late", lambda: ran.append("late"), 30, exclusive=False)
    hooks.register("first", lambda: ran.append("first"), 5, exclusive=False)
    hooks.register("middle", lambda: ran.append("middle"), 10, exclusive=False)
    hooks.register("middle-too", lambda: ran.append("middle-too"), 10, exclusive=False)  # after its equal
    assert hooks.names() == ["first", "middle", "middle-too", "late"]
    probe.cut()
    probe.cut()
    assert ran == ["first", "middle", "middle-too", "late"] * 2
    hooks.unregister("middle")
    ran.clear()
    probe.cut()
    assert ran == ["first", "middle-too", "late"]
    for name in ("first", "middle-too", "late"):
        hooks.unregister(name)
    assert probe.on_step is None
    ran.clear()
    probe.cut()
    assert ran == []


def test_a_hook_that_raises_is_removed_after_repeated_failures_and_never_raises() -> None:
    probe = _probe()
    hooks = probe.hooks
    calls = {"bad": 0, "good": 0}

    def bad() -> None:
        calls["bad"] += 1
        raise RuntimeError("broken hook")

    def good() -> None:
        calls["good"] += 1

    hooks.register("bad", bad, 1, exclusive=False)
    hooks.register("good", good, 2, exclusive=False)
    assert MAX_FAILURES > 1  # repeated: one failure does not remove a hook
    for _ in range(MAX_FAILURES - 1):
        probe.cut()  # never raises into the training loop
    assert hooks.names() == ["bad", "good"]  # one failure, or two, is not enough
    probe.cut()
    assert hooks.names() == ["good"] and "broken hook" in hooks.removed["bad"]
    for _ in range(3):
        probe.cut()
    assert calls == {"bad": MAX_FAILURES, "good": MAX_FAILURES + 3}  # the next hook ran every time
    assert probe.failures == 0 and probe.active  # a hook's failure is the hook's, not the probe's
    hooks.unregister("good")
    assert probe.on_step is None


def test_one_exclusive_hook_holds_the_step_by_the_rule() -> None:
    assert RULE[None, False] is Claim.TAKE
    assert RULE[Phase.ARMED, True] is Claim.DISPLACE and RULE[Phase.ARMED, False] is Claim.WAIT
    assert RULE[Phase.OPEN, True] is Claim.WAIT and RULE[Phase.OPEN, False] is Claim.WAIT
    probe = _probe()
    hooks = probe.hooks

    def count() -> None:
        pass

    def capture() -> None:
        pass

    assert hooks.register("flops", count, Order.FLOP_COUNT)
    assert hooks.phase("flops") is Phase.ARMED
    assert hooks.register("capture", capture, Order.CAPTURE)  # outranks an armed count: displaces it
    assert hooks.names() == ["capture"] and not hooks.open("flops", count)  # displaced: it must not start
    assert not hooks.register("flops", count, Order.FLOP_COUNT)  # ranks after the holder: waits
    hooks.unregister("capture", capture)
    assert hooks.register("flops", count, Order.FLOP_COUNT) and hooks.open("flops", count)
    assert hooks.phase("flops") is Phase.OPEN
    assert not hooks.register("capture", capture, Order.CAPTURE)  # the count's step is open: waits
    assert hooks.claim(Order.CAPTURE) is Claim.WAIT
    hooks.register("observer", lambda: None, 99, exclusive=False)  # not exclusive: always taken
    assert hooks.names() == ["flops", "observer"]
    hooks.unregister("flops", capture)  # another's callback: not removed
    assert hooks.holds("flops")
    hooks.unregister("flops")
    assert hooks.register("capture", capture, Order.CAPTURE)
    assert hooks.register("capture", capture, Order.CAPTURE)  # again: replaced, not refused by itself
    assert hooks.names() == ["capture", "observer"]


def test_a_switched_off_probe_drops_its_hooks_and_takes_no_more() -> None:
    probe = _probe()
    probe.hooks.register("capture", lambda: None, Order.CAPTURE)
    probe.disable()
    assert probe.on_step is None and probe.hooks.names() == []
    assert not probe.hooks.register("capture", lambda: None, Order.CAPTURE)
    assert probe.on_step is None
