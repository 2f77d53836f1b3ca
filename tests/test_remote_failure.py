"""A worker killed in the middle of a run: a clear error within the timeout, and the
coordinator exits cleanly, leaving no process behind."""

from __future__ import annotations

from remote_run import coordinate, no_worker_left


def test_killing_a_worker_mid_run_raises_and_the_coordinator_exits_cleanly(tmp_path):
    out = coordinate("""
        import signal, threading
        def kill_when_running():
            for _ in range(2000):
                if os.path.exists("pid.txt"):
                    os.kill(int(open("pid.txt").read()), signal.SIGKILL)
                    return
                time.sleep(0.01)
        threading.Thread(target=kill_when_running, daemon=True).start()
        g = Graph.somatize(Body().at("gpu") >> Sleepy("pid.txt", 60).at("gpu") >> Head())
        msg, took = worker_error(g, x, workers={"gpu": Worker.embedded(timeout=30)})
        assert took < 30, "it waited for the timeout, or longer"
        assert "'gpu'" in msg and "sleepy" in msg, msg
        print("PID", open("pid.txt").read())
        g.close()
        g.close()
        # a later run in the same process still gets a worker
        with Graph.somatize(Body().at("gpu") >> Head()) as g2:
            assert torch.equal(g2.forward(x), Graph.somatize(Body() >> Head()).forward(x))
        print("MSG", msg)
    """, tmp_path)
    assert "was lost while running" in out, out
    assert no_worker_left([out.split("PID")[1].split()[0]])
