"""Wrappers that take the wrapped function's own parameters (agent/wrap.py)."""

from __future__ import annotations

import functools
import math
import traceback

import pytest

from torchtop.agent.hooks.wrap import mirror, signature_wrapper

_LOG = """
def {name}({params}):
    _tt_calls.append({first})
    return _tt_orig({call})
"""


def _wrap(fn):
    calls: list = []
    return signature_wrapper(fn, _LOG, {"_tt_calls": calls}, "w"), calls


def test_every_kind_of_parameter_passes_through_unchanged() -> None:
    sentinel = object()

    def fn(a, b=sentinel, /, c=2, *rest, d, e=sentinel, **kw):
        return a, b, c, rest, d, e, kw

    w, calls = _wrap(fn)
    assert w(1, d=4) == fn(1, d=4)
    assert w(1, 2, 3, 9, 9, d=4, e=5, z=6) == fn(1, 2, 3, 9, 9, d=4, e=5, z=6)
    assert w(1, d=4)[1] is sentinel and w(1, d=4)[5] is sentinel  # the defaults are the same objects
    assert calls == [1, 1, 1, 1]
    with pytest.raises(TypeError):
        w(1)  # d is required, as it is for fn
    assert w(1, b=2, d=4) == fn(1, b=2, d=4)  # a positional-only name passed by keyword lands in **kw
    assert w.__name__ == "fn" and w.__wrapped__ is fn  # functools.wraps


def test_parameters_named_like_the_template_or_unreadable_fall_back_to_packing() -> None:
    def fn(_tt_orig, x=1):
        return _tt_orig + x

    assert mirror(fn) is None
    w, calls = _wrap(fn)
    assert w(1, x=2) == 3 and calls == [1]
    hypot = mirror(math.hypot)
    assert hypot is None or hypot[2]  # a builtin: packing, or its own signature
    w, calls = _wrap(math.hypot)
    assert w(3, 4) == 5.0 and calls == [3]


def test_a_method_keeps_binding_and_its_self() -> None:
    class Box:
        def __init__(self) -> None:
            self.v = 7

        def get(self, add=0):
            return self.v + add

    orig = Box.get
    w, calls = _wrap(orig)
    Box.get = w
    box = Box()
    assert box.get() == 7 and box.get(add=1) == 8 and calls == [box, box]


def test_a_partial_or_a_callable_object_is_wrapped_too() -> None:
    def add(a, b):
        return a + b

    w, calls = _wrap(functools.partial(add, 1))
    assert w(2) == 3 and calls == [2]


@pytest.mark.parametrize("name", ["<lambda>", "class", ""])
def test_a_name_that_is_no_identifier_still_wraps(name: str) -> None:
    calls: list = []
    w = signature_wrapper(lambda x, y=3: x + y, _LOG, {"_tt_calls": calls}, name)
    assert w(1) == 4 and w(1, y=1) == 2 and calls == [1, 1]


def test_a_traceback_through_a_wrapper_says_whose_wrapper_it_is() -> None:
    """Issue 39: a KeyboardInterrupt's traceback showed `File "<torchtop backward>"` and no line:
    the file names the wrapped function, and linecache holds the wrapper's source."""

    def backward(x):
        raise KeyboardInterrupt

    w, _ = _wrap(backward)
    try:
        w(1)
    except KeyboardInterrupt as exc:
        text = "".join(traceback.format_exception(exc))
    name = f"<torchtop wrapper of {backward.__module__}.{backward.__qualname__}>"
    assert f'File "{name}", line 4, in w' in text, text
    assert "return _tt_orig(x)" in text, text  # the wrapper's line: it passes the call on
    assert w.__code__.co_filename.startswith("<torchtop ")  # still torchtop's own (frames.py)
    other = signature_wrapper(backward, _LOG.replace("_tt_calls.append", "_tt_calls.extend"), {}, "w")
    assert other.__code__.co_filename != name  # another source: its own name, its own lines
