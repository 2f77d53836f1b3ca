"""Where the time goes: a split fit with trace= writes a Chrome trace-event file with a
lane per process, spans named by node, transfers with their bytes, and one optimizer-step
span per optimizer step on each side; the strategy logs its traffic each epoch."""

import json
from collections import Counter

import torch
from scenario import scenario


def lanes(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]  # the format Perfetto and chrome://tracing read
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    return names, spans


def test_a_split_fit_traces_each_process_in_its_own_lane(tmp_path):
    out = tmp_path / "traced.pt"
    scenario("dropin_runs.py", "traced", out, timeout=300)
    got = torch.load(out)
    for route, worker, node, steps in (("lightning", "worker", "encoder",
                                        got["lightning_steps"]),
                                       ("trainer", "gpu", "body", got["trainer_steps"])):
        names, spans = lanes(f"{out}.{route}.json")
        here = got["pid"]
        there = next(pid for pid, name in names.items() if name == worker)
        assert names[here] == "coordinator" and there != here
        by = Counter((e["pid"], e["name"]) for e in spans)
        assert by[(there, f"forward {node}")] >= steps  # named by node, run over there
        # transfers carry the bytes of the tensors they moved
        sent = [e for e in spans if e["pid"] == here and e["name"].startswith("send to")]
        assert sent and all("bytes" in e["args"] for e in sent)
        assert max(e["args"]["bytes"] for e in sent) >= 4 * 16 * 8  # a batch of inputs
        # one optimizer step span per step, here and over there
        assert by[(here, "optimizer step here")] == steps, by
        stepped_there = sum(n for (pid, name), n in by.items()
                            if pid == there and name.startswith("optimizer step"))
        assert stepped_there == steps, by
        assert all(e["dur"] >= 0 for e in spans)
    # the strategy's traffic in the logger, once an epoch
    metrics = got["metrics"]
    assert len(metrics) == 2
    assert all(float(m["somatize/bytes_sent"]) > 0 and float(m["somatize/bytes_received"]) > 0
               and float(m["somatize/wait_ms"]) > 0 for m in metrics)
