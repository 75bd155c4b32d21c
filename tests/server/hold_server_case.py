"""Not part of the suite (pytest collects ``test_*.py`` only): ``test_process_lifetime`` runs this
file in a child pytest that holds a real server, then SIGKILLs that pytest."""

from __future__ import annotations

import json
import os
import time


def test_hold_a_server(start_server):
    srv = start_server("--max-batch", "1")
    model = next(iter(srv.get_json("/health")["models"].values()))
    out = os.environ["SUPERFLUID_HOLD_PIDS"]
    with open(out + ".tmp", "w") as f:
        json.dump({"server": srv.proc.pid, "worker": model["worker_pid"]}, f)
    os.replace(out + ".tmp", out)
    time.sleep(300)  # until the parent test kills this pytest
