"""In-place recovery at scale: the deterministic simulator's rate, and a latency model of one recovery at
64, 512 and 8,000 ranks, driven by the policies the real processes run.

1. **The simulator** (`tests/unit/test_protocol_sim.py`): schedules a minute of `random_schedule` on
   this machine (target >= 10,000), and how its seeded schedules ended.
2. **Calibration**: a real torch `TCPStore` on 127.0.0.1 (a server, clients in threads of this process):
   one client's round trip per `add` / `get` / `check` / `multi_get` of 1,000 keys, a new connection, the
   most requests a second several clients get through (the server's one loop serialises them: its
   service time per request is 1 / that rate), and the wake of 32 waiters blocked on one key.
3. **The model**: a discrete-event simulation of one rank's death. The store is one FIFO server (each
   request costs the calibrated service time; a client sees it after half a round trip each way); its
   background load is what the code sends while nothing fails (per node a beat and the pool's look, 4 a
   second each); the dead rank's host, its spare and every survivor run the request sequence of
   `training.inplace.host` / `spare` / `group.InPlaceGroup.form`, deciding at each look with
   `decide_host` and `decide_form`: the host sees the exit, counts the rank lost and claims the spare
   (compare-and-set), assigns it; every survivor looks at its rank's owner, records its generation,
   joins the counter, and waits for the formed key on a connection of its own, looking at the counter and
   the lost-node key once a beat meanwhile (and the two watchers at every node's beat); the member whose
   join completes the count sets the formed key and the store wakes every waiter; then each member gets
   the NCCL id from the generation's prefix store. After the store: the state transfer (the lost rank's
   shard, bytes / bandwidth), the all-gather of the steps (a ring: one hop per rank), one step recomputed.
   Communicator initialisation beyond the store is an assumption (docs/performance.md), not modelled.

Two stores are modelled: the one calibrated here (this loaded 2-core machine, server and clients on the
same cores) and a store on a core of its own at 100,000 requests a second (the paper model's figure).
"""

from __future__ import annotations

import heapq
import random
import statistics
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import RESULTS
from bench.sections.base import Results, Section
from training.inplace import BEAT_S
from training.inplace.protocol import (
    ClaimSpare,
    Formed,
    FormObservation,
    HostObservation,
    HostState,
    Promote,
    Wait,
    decide_form,
    decide_host,
)

SIZES = (64, 512, 8000)
NPROC = 8  # ranks per node
SIM_TARGET_PER_MIN = 10_000
POLL_S = 0.02  # `training.inplace.host.POLL_S`: a host looks at its trainer this often
POOL_REQUESTS = 3  # a pool's look once a beat: the lost and waiting counters, its spare's claim key
STATE_BYTES = 14e9  # the lost rank's HSDP shard of a 7B model with fp32 Adam (112 GB / 8 GPUs)
BANDWIDTH = 50e9  # bytes/s: 400 Gb/s
HOP_S = 20e-6  # one hop of the steps' all-gather (a ring: world - 1 hops)
HORIZON_S = 30.0  # a recovery whose store part is not done by then: the store is saturated
STEP_S = 1.0  # the step recomputed (the paper model's "one step": a parameter, not a measurement)
DEDICATED_OPS_PER_S = 100_000  # a libuv TCPStore on a core of its own (the paper model's figure)
# docs/performance.md's paper model of in-place recovery at 1,000 nodes: rejoin = ~3 requests per rank.
PAPER_REQUESTS_PER_RANK = 3
PAPER_OPS_PER_S = (100_000, 25_000)


# -- 1. the simulator's rate ------------------------------------------------------------------------
def bench_simulator(seconds: float) -> Results:
    """Schedules a minute of the deterministic simulator on this machine, and its seeded outcomes."""
    from tests.unit import test_protocol_sim as sim

    cpu, wall = time.process_time(), time.perf_counter()
    rate = sim.rate(seconds)
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)  # of one core: the machine's load
    return {
        "schedules_per_minute": rate,
        "cpu_share": share,
        "schedules_per_cpu_minute": rate / max(share, 1e-9),
        "seconds": seconds,
        "target_per_minute": SIM_TARGET_PER_MIN,
        "meets_target": rate >= SIM_TARGET_PER_MIN,
        "outcomes_of_2000_seeded": sim.run_seeded(2000, 34),
        "known_defects": sorted(sim.KNOWN_DEFECTS),
    }


# -- 2. calibration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreCosts:
    """What one TCPStore costs (seconds).

    Attributes:
        service_s: The server's time per request (1 / the most requests a second it got through).
        rtt_s: A client's round trip beyond the service time (network and client).
        multi_get_per_key_s: The server's time per key of a `multi_get`.
        connect_s: A new client connection, as its client sees it.
        wake_s: The server's time to wake one waiter when its key is set: one answer written, the service
            time. (The wake of 32 waiter threads measured here is reported beside it: on this machine it is
            the clients' threads being scheduled, not the server.)
    """

    service_s: float
    rtt_s: float
    multi_get_per_key_s: float
    connect_s: float
    wake_s: float


def calibrate(repeats: int = 3, ops: int = 1000) -> Results:
    """Measure a real TCPStore on 127.0.0.1; the best of `repeats` of each figure (the least disturbed by
    the machine's other load), with every repeat kept."""
    from torch._C._distributed_c10d import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))

    def client() -> Any:
        return TCPStore(
            "127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60)
        )

    def per_op(fn: Callable[[], Any], n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    one = client()
    one.set("key", "v")
    beats = [f"node{n}/beat" for n in range(1000)]
    for key in beats:
        one.add(key, 1)
    runs: dict[str, list[float]] = {
        k: [] for k in ("add_s", "get_s", "check_s", "multi_get_1000_s", "connect_s", "ops_per_s", "wake_32_s")
    }
    for _ in range(repeats):
        runs["add_s"].append(per_op(lambda: one.add("counter", 1), ops))
        runs["get_s"].append(per_op(lambda: one.get("key"), ops))
        runs["check_s"].append(per_op(lambda: one.check(["key"]), ops))
        runs["multi_get_1000_s"].append(per_op(lambda: one.multi_get(beats), max(10, ops // 50)))
        runs["connect_s"].append(per_op(client, 10))
        runs["ops_per_s"].append(max(_throughput(client, threads, ops) for threads in (2, 4, 8)))
        runs["wake_32_s"].append(_wake(client, one, 32))
    best = {k: (max(v) if k == "ops_per_s" else min(v)) for k, v in runs.items()}
    service = 1.0 / best["ops_per_s"]
    costs = StoreCosts(
        service_s=service,
        rtt_s=max(best["add_s"] - service, 10e-6),
        multi_get_per_key_s=max(best["multi_get_1000_s"] - best["add_s"], 0.0) / 1000,
        connect_s=best["connect_s"],
        wake_s=service,
    )
    return {"measured": best, "runs": runs, "costs": asdict(costs)}


def _throughput(client: Callable[[], Any], threads: int, ops: int) -> float:
    clients = [client() for _ in range(threads)]

    def work(store: Any) -> None:
        for _ in range(ops):
            store.add("load", 1)

    workers = [threading.Thread(target=work, args=(store,)) for store in clients]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * ops / (time.perf_counter() - start)


def _wake(client: Callable[[], Any], setter: Any, waiters: int) -> float:
    """Seconds from setting a key until the last of `waiters` blocked on it returned."""
    key = f"go/{time.perf_counter_ns()}"
    clients = [client() for _ in range(waiters)]
    woke: list[float] = []
    lock = threading.Lock()

    def wait(store: Any) -> None:
        store.wait([key])
        with lock:
            woke.append(time.perf_counter())

    threads = [threading.Thread(target=wait, args=(store,)) for store in clients]
    for t in threads:
        t.start()
    time.sleep(0.5)  # every waiter's request is at the server
    start = time.perf_counter()
    setter.set(key, "1")
    for t in threads:
        t.join()
    return max(woke) - start


# -- 3. the model -----------------------------------------------------------------------------------
# What a client generator yields: ("op", Request), ("sleep", seconds), ("get", key): a get that blocks
# until the key is set, ("keywait", key): a `KeyWait` (one blocking wait on a connection of its own; returns
# its handle), ("until", (handle, t)): until that wait returns (True) or time t (False), whichever first.
Op = tuple[str, Any]


@dataclass
class Request:
    """One request: its server time, and what it does to the store's state when served (its answer)."""

    cost: float
    effect: Callable[[], Any] | None = None


class Model:
    """One store (a FIFO server), the clients' generators, and a clock of events."""

    def __init__(self, costs: StoreCosts) -> None:
        self.c = costs
        self.now = 0.0
        self.free_at = 0.0  # when the server's loop is next free
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.keys: dict[str, Any] = {}
        self.counters: dict[str, int] = {}
        self.waiters: dict[str, list[Callable[[float], None]]] = {}
        self.requests = 0
        self.background_requests = 0
        self.busy_s = 0.0
        self.max_wait_s = 0.0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn))

    def serve(self, cost: float) -> float:
        """A request that reached the server now: when its answer leaves."""
        start = max(self.now, self.free_at)
        self.max_wait_s = max(self.max_wait_s, start - self.now)
        self.free_at = start + cost
        self.requests += 1
        self.busy_s += cost
        return self.free_at

    def add(self, key: str, n: int) -> int:
        self.counters[key] = self.counters.get(key, 0) + n
        return self.counters[key]

    def set(self, key: str, value: Any) -> None:
        self.keys[key] = value
        for wake in self.waiters.pop(key, []):
            wake(self.serve(self.c.wake_s))  # the loop answers each waiter in turn

    def run(self, client: Generator[Op, Any, None], start: float) -> None:
        """Drive `client` from `start`: each request reaches the server half a round trip later, its answer
        the client half a round trip after the server served it."""
        half = self.c.rtt_s / 2

        def resume(value: Any = None) -> None:
            try:
                kind, arg = client.send(value)
            except StopIteration:
                return
            if kind == "sleep":
                self.at(self.now + arg, resume)
            elif kind == "op":

                def arrive(request: Request = arg) -> None:
                    done = self.serve(request.cost)
                    answer = request.effect() if request.effect is not None else None
                    self.at(done + half, lambda: resume(answer))

                self.at(self.now + half, arrive)
            elif kind in ("get", "keywait"):
                handle: dict[str, Any] = {"at": None, "then": None}

                def woken(t: float, handle: dict[str, Any] = handle) -> None:
                    handle["at"] = t
                    if handle["then"] is not None:
                        self.at(t, handle["then"])

                def register(key: str = arg) -> None:
                    done = self.serve(self.c.service_s)
                    if key in self.keys:
                        woken(done + half)
                    else:
                        self.waiters.setdefault(key, []).append(lambda done: woken(done + half))

                self.at(self.now + half, register)
                if kind == "keywait":
                    self.at(self.now, lambda: resume(handle))
                else:
                    handle["then"] = lambda: resume(True)
            elif kind == "until":
                handle, until = arg
                if handle["at"] is not None:
                    self.at(max(self.now, handle["at"]), lambda: resume(True))
                else:
                    fired = [False]

                    def once(value: bool) -> None:
                        if not fired[0]:
                            fired[0] = True
                            handle["then"] = None
                            resume(value)

                    handle["then"] = lambda: once(True)
                    self.at(until, lambda: once(False))
            else:
                raise ValueError(kind)

        self.at(start, resume)

    def background(self, rate: float, until: float) -> None:
        """Requests nobody waits for, `rate` a second, evenly spread (beats, pools' looks)."""
        if rate <= 0:
            return
        gap = 1.0 / rate
        phase = [random.Random(0).random() * gap]  # not in step with the death

        def tick() -> None:
            self.serve(self.c.service_s)
            self.background_requests += 1
            if self.now + gap < until:
                self.at(self.now + gap, tick)

        self.at(phase[0], tick)

    def loop(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            self.now, _, fn = heapq.heappop(self.events)
            fn()


@dataclass
class Recovery:
    """What one modelled recovery took (seconds from the death)."""

    world: int
    host_assigned_s: float = 0.0  # the host assigned the spare
    spare_joined_s: float = 0.0
    last_join_s: float = 0.0  # the join counter reached the world size
    last_woken_s: float = 0.0  # the last member learnt the generation formed
    store_done_s: float = 0.0  # the last member got the NCCL id: the store's part is over
    beat_looks: int = 0  # members' once-a-beat looks while waiting
    requests: int = 0
    max_queue_s: float = 0.0
    background_per_s: float = 0.0
    utilisation_before: float = 0.0
    fell_back: str | None = None


def model_recovery(world: int, costs: StoreCosts, *, nproc: int = NPROC, background: bool = True) -> Recovery:
    """One rank's death at `world` ranks: the store's part of in-place recovery, request by request."""
    m = Model(costs)
    nodes = max(1, world // nproc)
    out = Recovery(world)
    dead, gen = world - 1, 1
    limit = 60.0  # restarts.inPlaceTimeoutSeconds (the default)
    bg = nodes * (1 + POOL_REQUESTS) / BEAT_S if background else 0.0
    out.background_per_s, out.utilisation_before = bg, bg * costs.service_s
    m.background(bg, until=HORIZON_S)
    s = costs.service_s
    m.keys["spare/ready"] = 4242

    def req(effect: Callable[[], Any] | None = None, cost: float = s) -> Op:
        return ("op", Request(cost, effect))

    def host() -> Generator[Op, Any, None]:
        yield ("sleep", POLL_S / 2)  # it sees the exit at its next look
        stepped = yield req(lambda: True)  # its `stepped` mark
        finished = yield req(lambda: None)  # its `finished` mark (absent)
        seen = HostObservation(exit_code=137, stepped=stepped, finished=finished is not None)
        decision = decide_host(HostState.TRAINING, seen)
        assert isinstance(decision, ClaimSpare), decision
        yield req(lambda: m.add("lost", 1))
        yield req(lambda: m.add("waiting", 1))
        look = HostObservation(exit_code=137, timeout_s=limit)
        assert isinstance(decide_host(HostState.CLAIMING, look), Wait)
        yield req(lambda: 1)  # spares started
        yield req(lambda: False)  # its claim key: unset
        pid = yield req(lambda: m.keys["spare/ready"])
        yield req(lambda: m.keys.setdefault("spare/claim", dead))  # compare-and-set
        decision = decide_host(HostState.CLAIMING, replace(look, claimed_pid=pid))
        assert isinstance(decision, Promote), decision
        yield req(lambda: m.add("waiting", -1))
        yield req(lambda: m.keys.__setitem__(f"rank{dead}/owner", pid))
        yield req(lambda: gen - 1)  # the dead rank's generation
        out.host_assigned_s = m.now + costs.rtt_s / 2
        yield req(lambda: m.set("spare/assign", gen))  # wakes the spare's wait

    def member(rank: int, pid: int, *, spare: bool) -> Generator[Op, Any, None]:
        if spare:
            yield ("get", "spare/assign")  # its one blocking wait for its orders
            yield req(lambda: m.keys["spare/assign"])  # reads them
        started = m.now
        owner = yield req(lambda: m.keys.get(f"rank{rank}/owner"))
        look = FormObservation(gen, world, rank, owner=None if owner is None else str(owner), pid=pid, limit_s=limit)
        if not isinstance(decision := decide_form(look), Wait):
            out.fell_back = f"rank {rank}: {decision}"
            return
        yield req()  # its generation (`rank_gen_key`)
        joined = yield req(lambda: m.add("join", 1))
        if joined >= world:
            out.last_join_s = m.now
        if spare:
            out.spare_joined_s = m.now
        if isinstance(decide_form(replace(look, owner=None, joined=joined)), Formed):
            yield req(lambda: m.set("formed", 1))  # the last member: wakes the others
        else:
            if rank in (0, world - 1):
                yield req(lambda: m.add("standbys", 0))
            yield ("sleep", costs.connect_s)  # `KeyWait`'s own connection
            wait = yield ("keywait", "formed")
            next_look = m.now + BEAT_S
            while True:
                done = yield ("until", (wait, next_look))
                lost = joined_now = None
                if not done:
                    out.beat_looks += 1
                    if rank in (0, world - 1):  # the watchers: every node's beat in one multi_get
                        yield req(cost=s + nodes * costs.multi_get_per_key_s)
                    joined_now = yield req(lambda: m.counters.get("join", 0))
                    if joined_now < world:
                        lost = yield req(lambda: None)
                    next_look = m.now + BEAT_S
                seen = replace(
                    look, owner=None, joined=joined_now, formed=done, nodes_lost=lost, elapsed_s=m.now - started
                )
                decision = decide_form(seen)
                if isinstance(decision, Formed):
                    break
                if not isinstance(decision, Wait):
                    out.fell_back = f"rank {rank}: {decision}"
                    return
        out.last_woken_s = max(out.last_woken_s, m.now)
        # `init_process_group` on the generation's prefix store: rank 0 sets the NCCL id, the others wait
        # for it (one blocking get each).
        if rank == 0:
            yield req(lambda: m.set("pg/nccl-id", 1))
        else:
            yield ("get", "pg/nccl-id")
        out.store_done_s = max(out.store_done_s, m.now)

    m.run(host(), 0.0)
    m.run(member(dead, 4242, spare=True), 0.0)  # the spare, waiting for its orders since before the death
    for rank in range(world - 1):
        m.run(member(rank, 1000 + rank, spare=False), 0.0)  # gloo: a dead peer is seen at once
    m.loop(until=HORIZON_S)
    out.requests, out.max_queue_s = m.requests - m.background_requests, m.max_wait_s
    if out.store_done_s == 0.0:
        out.fell_back = out.fell_back or f"not done within {HORIZON_S:g} s: the store is saturated"
    return out


def dedicated_costs(here: StoreCosts) -> StoreCosts:
    """`here`, with the server of a store on a core of its own (`DEDICATED_OPS_PER_S`)."""
    return replace(here, service_s=1.0 / DEDICATED_OPS_PER_S, wake_s=1.0 / DEDICATED_OPS_PER_S)


def mttr_table(costs: StoreCosts, sizes: tuple[int, ...] = SIZES) -> list[dict[str, Any]]:
    """Modelled in-place MTTR at each world size: the store's part, then the transfer, the all-gather of
    the steps and one step."""
    rows = []
    for world in sizes:
        rec = model_recovery(world, costs)
        quiet = model_recovery(world, costs, background=False)
        transfer = STATE_BYTES / BANDWIDTH
        gather = (world - 1) * HOP_S
        rows.append(
            {
                **asdict(rec),
                "store_done_without_background_s": quiet.store_done_s,
                "transfer_s": transfer,
                "all_gather_s": gather,
                "step_s": STEP_S,
                "mttr_s": None if rec.fell_back else rec.store_done_s + transfer + gather + STEP_S,
                "paper_rejoin_s": [PAPER_REQUESTS_PER_RANK * world / ops for ops in PAPER_OPS_PER_S],
            }
        )
    return rows


def plot(model: Results, out_dir: Path = RESULTS) -> Path:
    """inplace_scale.png: the store's part of a recovery against the world size, modelled for both stores,
    beside the paper model's rejoin term."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    stores = (("this_machine", "this machine's store", "C0"), ("dedicated_store_core", "a store on its own core", "C2"))
    for key, label, color in stores:
        rows = model[key]
        sizes = [r["world"] for r in rows]
        done = [r["store_done_s"] or float("nan") for r in rows]
        ax.plot(sizes, done, marker="o", color=color, label=f"{label}: store done")
        quiet = [r["store_done_without_background_s"] or float("nan") for r in rows]
        ax.plot(sizes, quiet, ls=":", marker=".", color=color, label=f"{label}, no background load")
    sizes = list(SIZES)
    for ops, style in zip(PAPER_OPS_PER_S, ("--", "-."), strict=True):
        paper = [PAPER_REQUESTS_PER_RANK * w / ops for w in sizes]
        ax.plot(sizes, paper, ls=style, color="grey", label=f"paper model's rejoin at {ops // 1000}k requests/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{w:,}" for w in sizes])
    ax.set_xlabel("ranks (8 per node)")
    ax.set_ylabel("seconds from the death")
    ax.set_title("in-place recovery: the store's part, modelled request by request")
    ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    path = out_dir / "inplace_scale.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def bench_inplace_scale(quick: bool) -> Results:
    sim = bench_simulator(5.0 if quick else 20.0)
    cal = calibrate(repeats=1 if quick else 3, ops=300 if quick else 1000)
    here = StoreCosts(**cal["costs"])
    model = {"this_machine": mttr_table(here), "dedicated_store_core": mttr_table(dedicated_costs(here))}
    plot(model)
    return {
        "simulator": sim,
        "calibration": cal,
        "model": {
            **model,
            "assumptions": {
                "nproc": NPROC,
                "state_bytes": STATE_BYTES,
                "bandwidth_bytes_per_s": BANDWIDTH,
                "hop_s": HOP_S,
                "step_s": STEP_S,
                "dedicated_ops_per_s": DEDICATED_OPS_PER_S,
                "communicator_init": "not modelled (docs/performance.md: seconds at 8,000 ranks, an assumption)",
            },
        },
        "median_service_us": statistics.median([1e6 / v for v in cal["runs"]["ops_per_s"]]),
    }


def markdown(results: Results) -> list[str]:
    """The section's tables for latest.md (empty when the run has none)."""
    sc = results.get("inplace_scale") or {}
    if "model" not in sc:
        return []
    sim, cal = sc["simulator"], sc["calibration"]["costs"]
    lines = [
        f"Protocol simulator: **{sim['schedules_per_minute']:,.0f} schedules/minute** on this machine (target "
        f">= {sim['target_per_minute']:,}; it had {sim['cpu_share'] * 100:.0f}% of a core: "
        f"{sim['schedules_per_cpu_minute']:,.0f} per minute of CPU); 2,000 seeded schedules ended: "
        + ", ".join(f"{k} {v}" for k, v in sorted(sim["outcomes_of_2000_seeded"].items()))
        + ".",
        "",
        f"TCPStore here: {cal['service_s'] * 1e6:.0f} µs of server per request ({1 / cal['service_s']:,.0f}/s), "
        f"round trip +{cal['rtt_s'] * 1e6:.0f} µs, connect {cal['connect_s'] * 1e3:.1f} ms, "
        f"multi_get {cal['multi_get_per_key_s'] * 1e6:.1f} µs per key; 32 waiter threads of one process woken "
        f"in {sc['calibration']['measured']['wake_32_s'] * 1e3:.1f} ms (their scheduling here; the model charges "
        "the server one service time per waiter).",
        "",
        "| ranks | store | background load | host assigned the spare | last join | last woken | store done "
        "(without background) | requests | longest queue | modelled MTTR | paper rejoin (100k/s, 25k/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, key in (("this machine", "this_machine"), ("own core, 100k/s", "dedicated_store_core")):
        for row in sc["model"][key]:
            paper = ", ".join(f"{v:.2f}" for v in row["paper_rejoin_s"])
            load = row["utilisation_before"] * 100
            cells = [_s(row[k]) for k in ("host_assigned_s", "last_join_s", "last_woken_s", "store_done_s")]
            mttr = "saturated" if row["mttr_s"] is None else f"**{row['mttr_s']:.2f}**"
            lines.append(
                f"| {row['world']:,} | {label} | {load:.0f}% | {' | '.join(cells)} "
                f"({_s(row['store_done_without_background_s'])}) | {row['requests']:,} | {row['max_queue_s']:.3f} | "
                f"{mttr} | {paper} |"
            )
    lines.append("")
    return lines


def _s(value: float) -> str:
    return f"{value:.3f}" if value else "-"  # 0: never reached within the horizon


SECTION = Section("inplace_scale", bench_inplace_scale)
