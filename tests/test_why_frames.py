"""Issue 39 item 3: the stack sampler names the user's own frame inside frameworks and compiled
models, and the function a wrapper chain wraps (torch.optim's, lr_scheduler's), not the wrapper.

Real threads and real torch on CPU (tests/test_why_agent.py: the sampler's other cases)."""

from __future__ import annotations

import inspect
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_why_agent import Blocked, line_of
from torchtop.agent.hooks.frames import WRAPS, Classifier, Kind, classifier_for
from torchtop.agent.hooks.probe import Probe
from torchtop.agent.hooks.timed import timed
from torchtop.agent.telemetry.stacks import StackSampler
from torchtop.contract.logcodes import FORWARD
from torchtop.contract.why import StackSample

torch = pytest.importorskip("torch")

FRAMEWORK = '''
"""A framework's loop: the user's model and callback are called from here."""


def fit(step, callback, b):
    step(b)
    callback(b)


def own_work(b):
    b.ready.set()  # the framework's own code, blocked: not the user's
    b.release.wait(10)


def forward(b):
    own_work(b)
'''


@pytest.fixture
def framework(tmp_path: Path) -> Any:
    """A package under a directory named site-packages, put on sys.path after the classifier is
    made (a script that adds a path; another environment's packages): still not the user's."""
    root = tmp_path / "lib" / "site-packages"
    (root / "fakefw").mkdir(parents=True)
    (root / "fakefw" / "__init__.py").write_text(textwrap.dedent(FRAMEWORK))
    classifier = classifier_for(torch)  # the agent starts before the script adds the path
    sys.path.insert(0, str(root))
    try:
        import fakefw  # type: ignore[import-not-found]

        yield fakefw, classifier
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("fakefw", None)


def _sample(body: Callable[[Blocked], None], classifier: Classifier) -> StackSample:
    with Blocked(body) as b:
        s = StackSampler(b.probe, classifier).sample()
    assert s is not None
    return s


def user_callback(b: Blocked) -> None:
    b.ready.set()
    b.release.wait(10)  # the user's callback, blocked


def test_a_frameworks_own_code_is_not_the_users(framework: tuple[Any, Classifier]) -> None:
    """The framework's frames (a site-packages path) are looked through: the user's frame that
    called it is named, with the framework's function it called."""
    fw, classifier = framework

    def body(b: Blocked) -> None:
        fw.fit(fw.own_work, lambda b: None, b)

    s = _sample(body, classifier)
    assert s.site.endswith(f"test_why_frames.py:{line_of(body, 'fw.fit')} {body.__qualname__}"), s.site
    assert s.callee == "fakefw:fit", s.callee


def test_a_callback_the_framework_calls_is_the_users_frame(framework: tuple[Any, Classifier]) -> None:
    """The innermost frame of the user's, below the framework's: their callback, not their main."""
    fw, classifier = framework

    def body(b: Blocked) -> None:
        fw.fit(lambda b: None, user_callback, b)

    s = _sample(body, classifier)
    assert s.site.endswith(f"test_why_frames.py:{line_of(user_callback, 'b.release.wait')} user_callback"), (
        s.site
    )
    assert s.caller.endswith(f"test_why_frames.py:{line_of(body, 'fw.fit')} {body.__qualname__}"), s.caller


def test_a_frameworks_loop_names_the_model_it_runs(framework: tuple[Any, Classifier]) -> None:
    """Trainer.train -> ... -> the model's forward (inside our forward wrapper): the callee is
    the model's forward, not the framework's entry point."""
    fw, classifier = framework

    def body(b: Blocked) -> None:
        fw.fit(timed(b.probe, FORWARD, fw.forward), lambda b: None, b)

    s = _sample(body, classifier)
    assert s.phase == FORWARD, s
    assert s.site.endswith(f" {body.__qualname__}"), s.site
    assert s.callee == "fakefw:forward", s.callee


def test_torch_and_library_wrappers_are_looked_through() -> None:
    c = classifier_for(torch)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, 10)  # wraps opt.step once more (patch_track_step_called)
    wrapper = opt.step.__func__ if hasattr(opt.step, "__func__") else opt.step
    assert c.kind(wrapper.__code__)[1:] == (Kind.TORCH, WRAPS)
    assert c.kind(torch.nn.Module._call_impl.__code__)[2] == WRAPS
    assert c.kind(inspect.unwrap(torch.optim.SGD.step).__code__)[2] == -1  # the function wrapped
    assert c.kind(user_callback.__code__)[1:] == (Kind.USER, -1)
    # clip_grad_norm_ runs through `_no_grad.<locals>._no_grad_wrapper`: the callee is clip_grad_norm_
    clip = torch.nn.utils.clip_grad_norm_
    assert c.kind(clip.__code__)[2] == WRAPS and c.kind(inspect.unwrap(clip).__code__)[2] == -1
    assert c.kind(_deprecated().__code__)[2] == WRAPS  # transformers' deprecate_kwarg closure
    assert c._kind_of("/tmp/torchinductor_someone/xp/cxp6abc.py") is Kind.COMPILED
    assert c._kind_of("<eval_with_key>.3") is Kind.COMPILED


def _deprecated() -> Callable[..., Any]:
    """A closure named as transformers' `deprecate_kwarg` names its own, compiled as a library's
    file (site-packages) so the classifier sees it as not the user's."""
    src = "def deprecate_kwarg(f):\n    def wrapper(f):\n        def wrapped_func(*a):\n            return f(*a)\n        return wrapped_func\n    return wrapper(f)\n"
    ns: dict[str, Any] = {}
    exec(compile(src, "/venv/lib/python3.11/site-packages/transformers/utils/deprecation.py", "exec"), ns)
    return ns["deprecate_kwarg"](print)


def _sampled(
    work: Callable[[], None], until: Callable[[Counter[tuple[str, str]]], bool], limit_s: float
) -> Counter[tuple[str, str]]:
    """(site, callee) of samples of a thread that runs `work` over and over, until `until` holds."""
    stop = threading.Event()
    probe: list[Probe] = []
    ready = threading.Event()

    def loop() -> None:
        probe.append(Probe())
        ready.set()
        while not stop.is_set():
            work()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    assert ready.wait(5)
    sampler = StackSampler(probe[0], classifier_for(torch))
    got: Counter[tuple[str, str]] = Counter()
    end = time.monotonic() + limit_s
    try:
        while time.monotonic() < end and not until(got):
            s = sampler.sample()
            if s is not None:
                got[(s.site, s.callee)] += 1
            time.sleep(0.002)
    finally:
        stop.set()
        t.join(30)
    return got


def test_an_optimizer_step_through_its_wrappers_names_the_step() -> None:
    """`opt.step()` under an lr scheduler runs lr_scheduler's wrapper, torch.optim's
    profile_hook_step wrapper and _use_grad before SGD.step: the callee is SGD.step."""
    params = [torch.zeros(4, requires_grad=True) for _ in range(400)]
    for p in params:
        p.grad = torch.ones(4)
    opt = torch.optim.SGD(params, lr=0.1, foreach=False)  # a Python loop over the params: samples land inside
    torch.optim.lr_scheduler.StepLR(opt, 10)

    def work() -> None:
        opt.step()

    at = f"test_why_frames.py:{line_of(work, 'opt.step()')} "

    def enough(got: Counter[tuple[str, str]]) -> bool:
        return sum(n for (site, _), n in got.items() if at in site) >= 20

    got = _sampled(work, enough, 20.0)
    here = Counter({callee: n for (site, callee), n in got.items() if at in site})
    assert here and here.most_common(1)[0][0] == "torch.optim.sgd:SGD.step", here
    assert not [c for c in here if "<locals>" in c or "_call_impl" in c], here


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 512)
        self.b = torch.nn.Linear(512, 512)

    def forward(self, x: Any) -> Any:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.slow  # torch.compile: seconds to tens of seconds on this machine
def test_a_compiled_models_forward_is_named_by_its_source() -> None:
    """Inductor's generated file (/tmp/torchinductor_*/...py Runner.call) is torch's, not the
    user's: the frame named is the model's forward, marked compiled, calling the graph's op."""
    model = torch.compile(Small())
    x = torch.randn(256, 64)
    with torch.no_grad():
        model(x)  # compiled here, before the sampling

    def work() -> None:
        with torch.no_grad():
            model(x)

    def enough(got: Counter[tuple[str, str]]) -> bool:
        return sum(n for (site, _), n in got.items() if "forward" in site or "torchinductor" in site) >= 10

    got = _sampled(work, enough, 30.0)
    sites = Counter({site: n for (site, _), n in got.items() if "forward" in site or "torchinductor" in site})
    assert sites and not [s for s in sites if "torchinductor" in s], got
    top, _ = sites.most_common(1)[0]
    first = line_of(Small.forward, "def forward")
    assert f"test_why_frames.py:{first}" in top or f"test_why_frames.py:{first + 1}" in top, top
    assert top.endswith(" Small.forward (compiled)"), top
    callees = Counter({callee: n for (site, callee), n in got.items() if site == top})
    assert callees.most_common(1)[0][0] and not [c for c in callees if "<locals>" in c], callees


@pytest.mark.slow  # torch.compile
def test_a_compiled_model_of_torchs_is_named_by_the_graphs_call() -> None:
    """nn.Sequential compiled has no frame of the user's inside: the loop's line calls the
    compiled graph, named by its op, not dynamo's OptimizedModule.__call__ or wrap_inline."""
    model = torch.compile(
        torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    )
    x = torch.randn(256, 64)
    with torch.no_grad():
        model(x)

    def work() -> None:
        with torch.no_grad():
            model(x)

    at = f"test_why_frames.py:{line_of(work, 'model(x)')} "

    def enough(got: Counter[tuple[str, str]]) -> bool:
        return sum(n for (site, c), n in got.items() if at in site and c.endswith(" (compiled)")) >= 10

    got = _sampled(work, enough, 30.0)
    here = Counter({callee: n for (site, callee), n in got.items() if at in site})
    top, _ = here.most_common(1)[0]
    assert top.endswith(" (compiled)") and "<locals>" not in top and "OptimizedModule" not in top, here
