"""Wrappers with the wrapped function's own signature.

A `def wrapper(*args, **kwargs)` packs a tuple and a dict at every call and unpacks them again
for the call it makes: measured in a training loop, it costs more than the rest of a hook. `signature_wrapper` writes that wrapper
(the body is a template of the hook's logic) and falls back to `*args, **kwargs` where the
signature cannot be read (builtins) or mirrored. Defaults are passed on as the very objects
the wrapped function has, so the call is the same call.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import linecache
import weakref
from collections.abc import Callable
from types import CodeType
from typing import Any

Fn = Callable[..., Any]  # a function of the user's or torch's, wrapped as it is
SetAttr = Callable[[object, str, object], None]  # AutoHooks._setattr: a patch, its undo kept
Undo = Callable[[Callable[[], object]], None]  # keeps a function that undoes a patch

_VAR_POS, _VAR_KW = inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD
_PREFIX = "_tt_"  # the template's own names start with this; a parameter that does is not mirrored
#: The code of each timing wrapper and the phase it times: the stack sampler (an agent thread)
#: tells the training thread's phase from the wrapper frames on its stack, on untimed steps too.
WRAPPER_PHASES: weakref.WeakKeyDictionary[CodeType, int] = weakref.WeakKeyDictionary()


def note_phase(fn: Fn, phase: int) -> Fn:
    """Record that frames of `fn` (a wrapper of ours) are inside `phase`; returns `fn`."""
    code = getattr(fn, "__code__", None)  # its own code, not the wrapped function's
    if code is not None:
        WRAPPER_PHASES[code] = phase
    return fn


def mirror(fn: Fn, follow_wrapped: bool = False) -> tuple[str, str, str, dict[str, Any]] | None:
    """(parameters, call arguments, first parameter, defaults) reproducing `fn`'s signature.

    `follow_wrapped`: where `fn`'s own signature is `(*args, **kwargs)` and it wraps another
    function (functools.wraps), mirror that one's: `fn` takes whatever it takes."""
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
        if follow_wrapped and [p.kind for p in sig.parameters.values()] == [_VAR_POS, _VAR_KW]:
            sig = inspect.signature(fn, follow_wrapped=True)
    except (TypeError, ValueError):
        return None
    params: list[str] = []
    call: list[str] = []
    defaults: dict[str, Any] = {}
    posonly = star = False
    for i, p in enumerate(sig.parameters.values()):
        name = p.name
        if not name.isidentifier() or name.startswith(_PREFIX):
            return None
        if p.kind is not p.POSITIONAL_ONLY and posonly:
            params.append("/")
            posonly = False
        default = ""
        if p.default is not p.empty:
            key = f"{_PREFIX}d{i}"
            defaults[key] = p.default
            default = f"={key}"
        if p.kind is p.POSITIONAL_ONLY:
            params.append(name + default)
            call.append(name)
            posonly = True
        elif p.kind is p.POSITIONAL_OR_KEYWORD:
            params.append(name + default)
            call.append(name)
        elif p.kind is p.VAR_POSITIONAL:
            params.append("*" + name)
            call.append("*" + name)
            star = True
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                params.append("*")
                star = True
            params.append(name + default)
            call.append(f"{name}={name}")
        else:  # VAR_KEYWORD
            params.append("**" + name)
            call.append("**" + name)
    if posonly:
        params.append("/")
    if not call or call[0].startswith("*") or "=" in call[0]:
        return None  # the templates need a first positional parameter (self, the iterator...)
    return ", ".join(params), ", ".join(call), call[0], defaults


def signature_wrapper(
    orig: Fn,
    template: str,
    names: dict[str, Any],
    name: str = "wrapper",
    follow_wrapped: bool = False,
) -> Fn:
    """`template` compiled as a function wrapping `orig`: `{params}` are orig's parameters,
    `{call}` the arguments that pass them on, `{first}` the first one; `names` are its globals
    (`_tt_orig` is orig). The result carries orig's metadata (functools.wraps)."""
    parts = mirror(orig, follow_wrapped)
    if parts is None:
        params, call, first, defaults = (
            f"{_PREFIX}self, *{_PREFIX}a, **{_PREFIX}k",
            f"{_PREFIX}self, *{_PREFIX}a, **{_PREFIX}k",
            f"{_PREFIX}self",
            {},
        )
    else:
        params, call, first, defaults = parts
    if not name.isidentifier() or keyword.iskeyword(name):  # a lambda's "<lambda>"
        name = "wrapper"
    source = template.format(name=name, params=params, call=call, first=first)
    namespace: dict[str, Any] = {**names, **defaults, f"{_PREFIX}orig": orig, "__builtins__": __builtins__}
    exec(compile(source, _source_name(orig, name, source), "exec"), namespace)  # noqa: S102 - our template
    return functools.wraps(orig)(namespace[name])


def _source_name(orig: Fn, name: str, source: str) -> str:
    """The wrapper's file name, saying whose wrapper it is ("<torchtop wrapper of
    torch.autograd.backward>": a user's traceback passes through it), its source in linecache
    so that tracebacks printed by the traceback module (3.13's default one too) show its line.
    Kept "<torchtop ..." (frames.py: torchtop's own code); the same name only for the same source."""
    label = f"{getattr(orig, '__module__', None) or ''}.{getattr(orig, '__qualname__', name)}".lstrip(".")
    lines = source.splitlines(True)
    filename = f"<torchtop wrapper of {label}>"
    for n in range(2, 100):
        got = linecache.cache.get(filename)
        if got is None or (len(got) > 2 and got[2] == lines):
            break
        filename = f"<torchtop wrapper of {label} #{n}>"
    linecache.cache[filename] = (len(source), None, lines, filename)  # no mtime: checkcache keeps it
    return filename
