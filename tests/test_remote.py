"""Embedded workers: a stretch of the graph runs in a local worker process, over RPC.

Each test runs its coordinator in a subprocess (RPC is initialised once per process).
"""

from __future__ import annotations

from remote_run import coordinate, no_worker_left


def test_the_seeds_graph_on_an_embedded_worker_equals_one_process(tmp_path):
    out = coordinate("""
        here = Graph.somatize(Body() >> Head()).forward(x)
        g = Graph.somatize(Body().at("gpu") >> Head())
        y = g.forward(x)
        pid = runtime_for(g).peers["gpu"].pid
        y2 = g.forward(Opaque(x))           # a second forward reuses the worker
        assert runtime_for(g).peers["gpu"].pid == pid
        assert pid != os.getpid()
        assert torch.equal(y, here) and torch.equal(y2, here), (y, here)
        g.close(); g.close()                # idempotent
        print("PID", pid)
    """, tmp_path)
    assert no_worker_left([out.split("PID")[1].split()[0]])


def test_the_coordinator_and_its_worker_listen_on_loopback_only(tmp_path):
    out = coordinate("""
        from remote_run import listening
        with Graph.somatize(Body().at("gpu") >> Head()) as g:
            g.forward(x)
            for pid in (os.getpid(), runtime_for(g).peers["gpu"].pid):
                print("LISTENS", pid, *listening(pid))
            # TensorPipe binds the hostname's interface unless told: here the hostname may
            # resolve to loopback anyway, so what each side told it is checked as well
            print("IFNAME", os.environ.get("TP_SOCKET_IFNAME"),
                  runtime_for(g).call("gpu", lambda live: os.environ.get("TP_SOCKET_IFNAME")))
    """, tmp_path)
    lines = [line.split()[2:] for line in out.splitlines() if line.startswith("LISTENS")]
    assert len(lines) == 2 and all(lines), out  # both listen, the rendezvous among them
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    assert {a for addrs in lines for a in addrs} <= loopback, out
    (ifname,) = [line.split()[1:] for line in out.splitlines() if line.startswith("IFNAME")]
    assert all(name.startswith("lo") for name in ifname), out


def test_tensors_cross_as_tensors_every_dtype_and_bit_kept(tmp_path):
    coordinate("""
        class Echo(Node):
            def forward(self, x, ctx):
                return Done(Opaque({k: v.clone() for k, v in x.items()}))
        sent = {"big": torch.tensor([2**60 + 1, -3]), "half": torch.randn(5).half(),
                "bf": torch.randn(5).bfloat16(), "bool": torch.tensor([True, False]),
                "view": torch.randn(4, 6)[:, ::2], "empty": torch.empty(0, 3)}
        with Graph.somatize(Echo().at("gpu")) as g:
            back = g.forward(sent)
        for k, v in sent.items():
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    """, tmp_path)


def test_a_big_matrix_product_over_there_equals_here_with_the_default_threads(tmp_path):
    coordinate("""
        from somatize.torch import node
        torch.set_num_threads(2)
        mlp = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                  torch.nn.Linear(1024, 1024))
        big, odd = torch.randn(256, 784), torch.randn(7, 784)
        here = Graph.somatize(node(mlp)).forward(big)
        here_odd = Graph.somatize(node(mlp)).forward(odd)
        with Graph.somatize(node(mlp).at("gpu")) as g:
            assert torch.equal(g.forward(big), here)
            # a batch of 7 comes out differently with 1 and 2 threads on this CPU: the
            # worker's default (as many threads as here) keeps the equality
            assert torch.equal(g.forward(odd), here_odd)
            assert runtime_for(g).call("gpu", lambda live: torch.get_num_threads()) == 2
            # and its math threads sleep once a node is done, not spin on our cores
            assert runtime_for(g).call("gpu", lambda live: os.environ["OMP_WAIT_POLICY"]) == \
                "PASSIVE"
    """, tmp_path)


def test_a_worker_is_started_with_what_the_environment_says_before_our_defaults():
    from somatize.remote._spawn import serving_env

    assert serving_env({})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert serving_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    assert serving_env({})["THP_MEM_ALLOC_ENABLE"] == "1"


def test_a_class_defined_in_the_script_travels_by_value(tmp_path):
    coordinate("""
        class Twice(Node):
            def forward(self, x, ctx):
                return Done(Opaque((x * 2, os.getpid())))
        class Take(Node):
            def forward(self, x, ctx):
                return Done(x)
        with Graph.somatize(Twice().at("gpu") >> Take()) as g:
            y, pid = g.forward(x)
        assert torch.equal(y, x * 2) and pid != os.getpid()
    """, tmp_path)


def test_an_opaque_read_only_over_there_does_not_stop_the_stretch(tmp_path):
    coordinate("""
        with Graph.somatize(Locked().at("gpu") >> Unlock().at("gpu")) as g:
            assert torch.equal(g.forward(x), x + 1)
        with Graph.somatize(Locked().at("gpu") >> Unlock()) as g:
            try:
                g.forward(x)
                raise SystemExit("no Lost")
            except Lost as e:
                msg = str(e)
        assert "'unlock'" in msg and "'locked'" in msg, msg
        assert "the coordinator (here)" in msg and "worker 'gpu'" in msg, msg
    """, tmp_path)


def test_an_outcome_leaves_behind_what_cannot_travel_and_keeps_what_it_answers_with(tmp_path):
    coordinate("""
        from somatize._engine import walk
        from somatize._values import Left
        g = Graph.somatize(Locked().at("gpu") | Scale().at("gpu"))
        with g:
            out = walk(g, g.plan.order, inputs={"locked": x, "scale": x},
                       remote=runtime_for(g), wanted=g.sinks)
        assert isinstance(out.values["locked"], Left), out.values
        assert out.values["locked"].node == "locked" and out.values["locked"].host == "gpu"
        assert "lock" in out.values["locked"].why, out.values["locked"]
        assert torch.equal(out.values["scale"].value, x * 2)
        assert sorted(out.ran) == ["locked", "scale"]
    """, tmp_path)


def test_a_value_from_one_worker_to_another_travels_as_an_rref(tmp_path):
    coordinate("""
        from somatize._engine import walk
        from torch._C._distributed_rpc import PyRRef
        here = Graph.somatize(Body() >> Scale() >> Head()).forward(x)
        g = Graph.somatize(Body().at("a") >> Scale().at("b") >> Head())
        with g:
            assert torch.equal(g.forward(x), here)
            out = walk(g, g.plan.order, inputs={"body": x}, remote=runtime_for(g),
                       wanted=g.sinks)
            assert isinstance(out.values["body"], PyRRef), out.values   # never came here
            assert torch.equal(out.values["head"].value, here)
    """, tmp_path)


def test_remote_stretches_of_one_wave_are_in_flight_together(tmp_path):
    # each node waits for the other's file: run one after the other, they would time out
    coordinate("""
        import pathlib
        class Meet(Node):
            def __init__(self, me, other):
                self.me, self.other = me, other
            def forward(self, x, ctx):
                pathlib.Path(self.me).touch()
                t = time.monotonic()
                while not pathlib.Path(self.other).exists():
                    if time.monotonic() - t > 20:
                        raise TimeoutError("the other stretch never started")
                    time.sleep(0.01)
                return Done(Opaque(x))
        a, b = "a.flag", "b.flag"
        g = Graph.somatize(Meet(a, b).named("ma").at("a") | Meet(b, a).named("mb").at("b"))
        with g:
            out = g.forward(x)
        assert torch.equal(out["ma"], x) and torch.equal(out["mb"], x)
    """, tmp_path)


def test_a_worker_that_keeps_does_not_run_again_what_it_kept(tmp_path):
    # CU13: no store here, one there; the names of what ran over there come back
    coordinate(f"""
        from somatize._engine import walk
        from somatize.torch import freeze
        store = {str(tmp_path / "there")!r}
        def ran(live):
            return type(live["scale"]).runs
        for keeps in (True, False):
            g = Graph.somatize(Scale().at("gpu").frozen().cached() >> Head(n_in=8))
            freeze(g)
            w = {{"gpu": Worker.embedded(store=store if keeps else None)}}
            with g:
                rt = runtime_for(g, w)
                assert rt.keeps() is keeps
                first = walk(g, g.plan.order, inputs={{"scale": x}}, remote=rt,
                             naming=rt.keeps(), wanted=g.sinks)
                second = walk(g, g.plan.order, inputs={{"scale": x}}, remote=rt,
                              naming=rt.keeps(), wanted=g.sinks)
                assert torch.equal(first.values["head"].value, second.values["head"].value)
                if keeps:
                    assert first.ran == ["scale", "head"] and second.hits == ["scale"]
                    assert second.ran == ["head"]
                    assert rt.call("gpu", ran) == 1
                    assert first.keys["scale"] and first.keys["scale"] == second.keys["scale"]
                    assert first.keys["head"]          # named here from the name that came back
                    y = g.forward(x, workers=w)        # Graph.forward names for it too
                    assert rt.call("gpu", ran) == 1
                else:
                    assert second.ran == ["scale", "head"] and not second.hits
                    assert rt.call("gpu", ran) == 2
    """, tmp_path, timeout=120)


def test_the_name_a_worker_is_brought_and_the_name_it_gives_back_are_one_processs(tmp_path):
    # CU13: the key of what feeds a stretch crosses with it; the key of what it ran comes
    # back; both are the names one process computes, and the worker keeps under them
    coordinate(f"""
        from somatize._engine import walk
        from somatize.store import Store
        from somatize.torch import freeze
        def build(at):
            return freeze(Graph.somatize(Scale(3.0).frozen() >> Scale().at(at).frozen().cached()
                                         >> Head(n_in=8)))
        one = build(None)
        local = walk(one, one.plan.order, inputs={{"scale": x}}, naming=True, wanted=one.sinks)
        g = build("gpu")
        there = {str(tmp_path / "there")!r}
        with g:
            rt = runtime_for(g, {{"gpu": Worker.embedded(store=there)}})
            out = walk(g, g.plan.order, inputs={{"scale": x}}, remote=rt, naming=True,
                       wanted=g.sinks)
        assert out.keys == local.keys and all(local.keys.values()), (out.keys, local.keys)
        assert list(Store(there).names()) == ["value/" + local.keys["scale_2"]]
    """, tmp_path)


def test_provisioning_refuses_a_different_catalog_on_an_open_session(tmp_path):
    coordinate("""
        g = Graph.somatize(Body().at("gpu") >> Head())
        g.provision()                                     # before any forward: not skipped
        w = runtime_for(g).call("gpu", lambda live: live["body"].lin.weight.clone())
        assert torch.equal(w, g["body"].lin.weight)
        other = Graph.somatize(Scale().at("gpu") >> Head(n_in=8))
        try:
            runtime_for(g).provision(other)
            raise SystemExit("not refused")
        except Refused as e:
            msg = str(e)
        assert "'body'" in msg and "'scale'" in msg and "gpu" in msg, msg
        g.close()
    """, tmp_path)


def test_an_exception_in_a_node_over_there_names_the_worker_and_the_node(tmp_path):
    coordinate("""
        with Graph.somatize(Body().at("gpu") >> Boom().at("gpu") >> Head()) as g:
            msg, _ = worker_error(g, x)
        assert "'boom'" in msg and "'gpu'" in msg and "ValueError" in msg, msg
        assert "boom inside the node" in msg and "Traceback" in msg, msg
    """, tmp_path)


def test_a_call_that_takes_too_long_fails_within_the_timeout(tmp_path):
    coordinate("""
        g = Graph.somatize(Sleepy("pid.txt", 30).at("gpu"))
        msg, took = worker_error(g, x, workers={"gpu": Worker.embedded(timeout=3)})
        assert "'gpu'" in msg and "sleepy" in msg and "3 s" in msg, msg
        assert took < 25, took      # bounded by the timeout, not by the 30 s sleep
        g.close()
    """, tmp_path)


def test_two_graphs_in_one_process_share_a_worker_each_with_its_own_catalog(tmp_path):
    out = coordinate("""
        g1 = Graph.somatize(Body().at("gpu") >> Head())
        g2 = Graph.somatize(Scale().at("gpu") >> Head(n_in=8))
        y1, y2 = g1.forward(x), g2.forward(x)
        pid = runtime_for(g1).peers["gpu"].pid
        assert runtime_for(g2).peers["gpu"].pid == pid           # one process, two sessions
        g1.close()
        assert torch.equal(g2.forward(x), y2)                # the other session lives on
        assert torch.equal(y1, Graph.somatize(Body() >> Head()).forward(x))
        g2.close()                                           # the last one stops it
        print("PID", pid)
    """, tmp_path)
    assert no_worker_left([out.split("PID")[1].split()[0]])


def test_a_normal_close_says_nothing_on_stderr(tmp_path):
    # TensorPipe warns about any pipe closing under an agent that has not left the group
    # ("encountered error when reading incoming request from gpu: EOF"): the close's order
    # must leave none. Trained and closed; two workers passing an RRef, closed together;
    # a group started again after the last worker left; one left open until exit.
    import subprocess
    import sys

    from remote_run import PRELUDE, env

    script = tmp_path / "quiet.py"
    script.write_text(PRELUDE + """
from torch.nn.functional import cross_entropy
from somatize.torch import Split, Trainer, parameters
g = Graph.somatize(Body().at("gpu") >> Head())
trains = {"body": Split(torch.optim.SGD, lr=0.1)}
data = [(x, torch.tensor([0, 1, 2, 0, 1]))] * 3
with Trainer(g, cross_entropy, torch.optim.SGD(parameters(g, without=trains), lr=0.1),
             trains=trains) as t:
    t.fit(data, epochs=2, progress=False)
with Graph.somatize(Body().at("a") >> Scale().at("b") >> Head()) as g2:
    g2.forward(x)
Graph.somatize(Body().at("gpu") >> Head()).forward(x)
print("done")
""")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120, env=env(), cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-4000:]
    assert r.stderr == "", r.stderr[-4000:]
