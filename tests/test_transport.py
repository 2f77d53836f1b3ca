"""The transport protocol the core owns (``somatize._holes.Runtime``) names every call the
layers above make on a runtime, and ``somatize.remote``'s runtime has each one, with the
same parameters. Read off the sources and the classes, by value; no worker starts."""

import dataclasses
import inspect
import re
from pathlib import Path

from somatize import Done, Graph, Node, _holes
from somatize.remote import Worker
from somatize.remote._peer import Peer
from somatize.remote._runtime import Runtime, _Pending

PACKAGE = Path(__file__).resolve().parent.parent / "somatize"


class Same(Node):
    def forward(self, x, ctx):
        return Done(x)


def methods(protocol) -> dict[str, list[tuple[str, object]]]:
    """A protocol's (or a class's) public methods: name -> its parameters' names and kinds."""
    return {n: [(p.name, p.kind) for p in inspect.signature(f).parameters.values()]
            for n, f in vars(protocol).items()
            if inspect.isfunction(f) and not n.startswith("_")}


def fields(protocol) -> set[str]:
    return {n for n in protocol.__annotations__ if not n.startswith("_")}


def calls_above() -> set[str]:
    """What the layers above the core read off a runtime: ``runtime.X`` (a step's, a
    tracer's, the transport's own tracing), and the traffic the strategy sums."""
    seen = set()
    for path in [*PACKAGE.glob("torch/**/*.py"), *PACKAGE.glob("lightning/*.py"),
                 PACKAGE / "remote" / "_tracing.py", *PACKAGE.glob("_*.py")]:
        seen |= set(re.findall(r"\bruntime\.([a-z]\w*)", path.read_text()))
    return seen | {"waited", "sent", "received"}


def test_the_protocol_names_every_call_the_layers_above_make_on_a_runtime():
    named = set(methods(_holes.Runtime)) | fields(_holes.Runtime)
    seen = calls_above()
    # the calls a step, a placed module, the tracer and the cache callback make today
    assert {"call", "call_async", "provision", "spec", "peers", "closed", "keeps"} <= seen
    assert seen <= named, (f"the layers above call {sorted(seen - named)} on a runtime, which "
                           "somatize._holes.Runtime does not name: add them there")
    # and each is said, not left as a bare name
    assert all(inspect.getdoc(getattr(_holes.Runtime, n)) for n in methods(_holes.Runtime))


def test_the_remote_runtime_has_every_member_of_the_protocol_with_its_parameters():
    ours = methods(Runtime)
    for name, params in methods(_holes.Runtime).items():
        assert name in ours, f"somatize.remote.Runtime has no {name}()"
        assert ours[name] == params, (name, ours[name], params)
    assert methods(_holes.Pending).keys() <= methods(_Pending).keys()
    with Graph.somatize(Same().at("gpu") >> Same()) as g:
        rt = Runtime(g)  # starts nothing until a call
        try:
            missing = {n for n in fields(_holes.Runtime) if not hasattr(rt, n)}
            assert not missing, f"a Runtime has no {sorted(missing)}"
            assert (rt.peers, rt.closed, rt.sent, rt.received, rt.waited) == ({}, False, 0, 0,
                                                                              0.0)
            assert rt.spec("gpu") == Worker.embedded() and rt.spec("gpu").threads is None
        finally:
            rt.close()
        assert rt.closed
    peer = {f.name for f in dataclasses.fields(Peer)}
    assert fields(_holes.Peer) <= peer and fields(_holes.Spec) <= {
        f.name for f in dataclasses.fields(Worker)}
