"""``somatize hub`` (serve studies' shared modules) and ``somatize fed`` (a study's
certificates; a round exported as a plain state_dict).

    somatize fed ca pki/                          # the study's CA: pki/ca.pem, pki/ca.key
    somatize fed cert pki/ hub hospital-a hospital-b
    somatize hub --study ct-2027.toml --listen 0.0.0.0:7443 --identity pki/hub.pem \\
        --ca pki/ca.pem --checkpoints /srv/somatize/fed --store /srv/somatize/store
    somatize fed export /srv/somatize/store ct-2027 --shared trunk --out ct-2027.pt
    somatize hub --average-only --study ct-2027.toml --listen 0.0.0.0:7444 \
        --identity pki/averager.pem --ca pki/ca.pem     # a study's averager ([fedavg] averager)
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path


def hub_main(argv: list[str]) -> int:
    """Serve the studies given until SIGTERM or Ctrl-C."""
    ap = argparse.ArgumentParser(prog="somatize hub", description=hub_main.__doc__)
    ap.add_argument("--study", action="append", required=True, help="a study's TOML file")
    ap.add_argument("--listen", required=True, help="HOST:PORT (port 0: any free port)")
    ap.add_argument("--identity", required=True, help="the hub's .pem (somatize fed cert)")
    ap.add_argument("--ca", required=True, help="the study's CA certificate")
    ap.add_argument("--checkpoints", help="write each round barrier's state here")
    ap.add_argument("--resume", action="store_true", help="start from the last barrier there")
    ap.add_argument("--store", help="keep each round's shared state and FedAvg in this "
                                    "store (what `somatize fed export` reads)")
    ap.add_argument("--keep-rounds", type=int, default=0,
                    help="the latest rounds of each study `somatize store gc` keeps "
                         "(default 0: every round)")
    ap.add_argument("--audit", help="write one JSON line per message received here")
    ap.add_argument("--ready", help="write the port listened on to this file once serving")
    ap.add_argument("--average-only", action="store_true",
                    help="serve as the studies' averager ([fedavg] averager = the name of "
                         "--identity): take the owners' parts at each barrier and answer "
                         "their average; no shared module")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hub %(message)s")
    from .._errors import Refused
    from ._averager import StudyAverager
    from ._config import StudyConfig
    from ._hub import StudyHub
    from ._link import serve

    hubs: dict = {}
    for path in args.study:
        cfg = StudyConfig.load(path)
        if args.average_only:
            if not cfg.averager:
                raise Refused(f"somatize hub --average-only: study {cfg.name!r} ({path}) "
                              "names no averager: its hub averages its parts")
            if args.checkpoints or args.store or args.resume:
                raise Refused("somatize hub --average-only keeps no round: drop "
                              "--checkpoints, --store and --resume")
            hubs[cfg.name] = StudyAverager(cfg)
        else:
            hubs[cfg.name] = StudyHub(cfg, args.checkpoints, resume=args.resume,
                                      store=args.store, keep_rounds=args.keep_rounds)
    server = serve(hubs, args.listen, args.identity, args.ca, audit=args.audit)
    host = args.listen.rpartition(":")[0]
    what = "averager" if args.average_only else "hub"
    print(f"somatize {what}: studies {sorted(hubs)} on {host}:{server.port}", flush=True)
    if args.ready:
        tmp = Path(args.ready + ".tmp")
        tmp.write_text(str(server.port))
        tmp.rename(args.ready)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.stop(1).wait(5)
    return 0


def export_main(argv: list[str]) -> int:
    """Write a round barrier of a study, read from the hub's store with its digests
    checked, as one plain state_dict of the whole model (the shared module under
    --shared, the round's FedAvg of the owners' parts): it loads into the
    LightningModule with torch.load and load_state_dict, without somatize."""
    ap = argparse.ArgumentParser(prog="somatize fed export", description=export_main.__doc__)
    ap.add_argument("store", help="the hub's --store directory")
    ap.add_argument("study", help="the study's name")
    ap.add_argument("--shared", required=True,
                    help="the shared module's path in the owners' model (place= key)")
    ap.add_argument("--round", type=int,
                    help="the barrier after this many rounds (default: the latest kept)")
    ap.add_argument("--out", required=True,
                    help="FILE.pt (torch.save) or FILE.safetensors")
    ap.add_argument("--shared-only", action="store_true",
                    help="the shared module alone (a study whose averager of its own "
                         "averaged the parts: the hub's store keeps no average)")
    args = ap.parse_args(argv)
    import torch

    from .._errors import Refused
    from ._rounds import export_round

    try:
        state = export_round(args.store, args.study, args.shared, args.round,
                             shared_only=args.shared_only)
    except Refused as e:
        print(f"somatize fed export: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out))
    else:
        torch.save(state, out)
    print(f"{out}: {len(state)} entries of study {args.study!r} "
          f"({sum(v.numel() for v in state.values())} numbers)")
    return 0


def fed_main(argv: list[str]) -> int:
    """``ca DIR``: make a study's CA; ``cert DIR NAME...``: a certificate per party;
    ``export STORE STUDY --shared PATH --out FILE``: a round as a state_dict."""
    from ._certs import issue, make_ca

    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    if len(argv) >= 2 and argv[0] == "ca":
        d = make_ca(argv[1])
        print(f"study CA: {d / 'ca.pem'} (keep {d / 'ca.key'} offline)")
        return 0
    if len(argv) >= 3 and argv[0] == "cert":
        make_ca(argv[1])
        for name in argv[2:]:
            print(f"{name}: {issue(argv[1], name)}")
        return 0
    print("usage: somatize fed ca DIR | somatize fed cert DIR NAME [NAME...] | somatize fed "
          "export STORE STUDY --shared PATH --out FILE [--round R]", file=sys.stderr)
    return 2
