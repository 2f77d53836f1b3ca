"""Draw a trace file (``Trainer(trace=...)``, ``SomatizeStrategy(trace=...)``) as a Gantt
chart: one row per process lane, a bar per span, coloured by kind; a window of a few steps.

    python scripts/trace_picture.py run.json docs/trace.png [--from-ms 200 --ms 60]

Needs matplotlib (the dev extra has it). Perfetto (ui.perfetto.dev) or chrome://tracing
open the same file interactively.
"""

from __future__ import annotations

import argparse
import json

COLOURS = {"node": "#4c72b0", "transfer": "#dd8452", "wait": "#cccccc", "step": "#55a868",
           "call": "#eeeeee"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--from-ms", type=float, default=None,
                    help="where the window starts, from the first span (default: the 3rd "
                         "optimizer step here, past the warm-up)")
    ap.add_argument("--ms", type=float, default=None, help="the window's width")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in spans)
    steps = sorted(e["ts"] for e in spans if e["name"] == "optimizer step here")
    start = (args.from_ms * 1000 + t0 if args.from_ms is not None
             else steps[min(2, len(steps) - 1)] if steps else t0)
    width = (args.ms * 1000 if args.ms is not None
             else (steps[min(5, len(steps) - 1)] - start if len(steps) > 3 else 50_000))
    lanes = sorted(names, key=lambda pid: names[pid] != "coordinator")
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.9 * len(lanes)))
    for row, pid in enumerate(lanes):
        for e in spans:
            if e["pid"] != pid or e["ts"] + e["dur"] < start or e["ts"] > start + width:
                continue
            x = (e["ts"] - start) / 1000
            outer = e["name"].startswith("training step")  # holds forward and backward
            ax.barh(row + (0.38 if outer else 0), e["dur"] / 1000, left=x,
                    height=0.12 if outer else 0.6, color=COLOURS.get(e.get("cat"), "#999999"),
                    edgecolor="white", lw=0.3)
            if e["dur"] > width / 12 and e.get("cat") not in ("call",) and not outer:
                ax.text(x + e["dur"] / 2000, row, e["name"].split(":")[0][:22], ha="center",
                        va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)), [names[p] for p in lanes])
    ax.set_xlim(0, width / 1000)
    ax.set_xlabel("ms")
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), ncol=5, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"wrote {args.png}: {len(lanes)} lanes, {width / 1000:.1f} ms from "
          f"{(start - t0) / 1000:.1f} ms")


if __name__ == "__main__":
    main()
