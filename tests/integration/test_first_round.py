"""A run launched on one node closes its first c10d round as soon as its agent joins (issue 36: the
one-node rendezvous waited its last call for a node that was not coming, and torch's random 0-0.3 s
skew before it), and keeps the last call in every later round (a group restart, a node added)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from training.contract import Env

LAST_CALL_S = 4  # long enough that a round that waits it cannot pass for one that did not, under load

_AGENT = f"""
import os, sys, time
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from training.contract import Env
from training.torchrun import export_rendezvous_round

slept = []  # what torch's rendezvous asked `_delay` for (the first round's random skew is a tuple)
real_delay = dynamic_rendezvous._delay
dynamic_rendezvous._delay = lambda seconds: (slept.append(seconds), real_delay(seconds))[1]
export_rendezvous_round()
params = RendezvousParameters(
    backend="c10d", endpoint=sys.argv[1], run_id="job", min_nodes=1, max_nodes=2, local_addr="node0",
    join_timeout="60", last_call_timeout="{LAST_CALL_S}",
)
backend, store = create_backend(params)
handler = create_handler(store, backend, params)
for round_ in range(2):
    start = time.monotonic()
    handler.next_rendezvous()
    print(time.monotonic() - start, flush=True)
    if round_ == 0:
        skews = sum(isinstance(s, tuple) for s in slept)
print(os.environ.get(Env.FIRST_ROUND_ALONE, "-"), flush=True)
print(skews, flush=True)
"""


def _rounds(alone: bool) -> tuple[float, float, str, int]:
    """Seconds of an agent's first and second round on a real c10d store, the variable it was left with, and
    how many times it slept torch's random skew before its first round."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)  # type: ignore[attr-defined]
    env = {k: v for k, v in os.environ.items() if k != Env.FIRST_ROUND_ALONE}
    if alone:
        env[Env.FIRST_ROUND_ALONE] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _AGENT, f"127.0.0.1:{server.port}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second, left, skews = done.stdout.split()
    return float(first), float(second), left, int(skews)


@pytest.mark.timeout(180)
def test_the_only_node_s_first_round_closes_without_the_last_call_and_later_rounds_keep_it() -> None:
    first, second, left, skews = _rounds(alone=True)
    assert first < LAST_CALL_S / 2, f"the first round waited {first:.2f} s"
    assert skews == 0, "alone, the first round sleeps no random skew (it spreads several nodes' joins)"
    assert second >= LAST_CALL_S - 0.5, f"a later round must keep the last call (took {second:.2f} s)"
    assert left == "-", "consumed by the first round: the workers never see it"


@pytest.mark.timeout(180)
def test_without_the_variable_the_first_round_waits_its_last_call() -> None:
    first, _, _, skews = _rounds(alone=False)
    assert first >= LAST_CALL_S - 0.5, f"the first round took {first:.2f} s"
    assert skews == 1, "torch's random skew before the first round, as torchrun has it"
