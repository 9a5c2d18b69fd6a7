"""Orders in the job's store (`training.contract.orders`): the job's secret, the MAC, the typed records a
spare and a standby host are handed, and every reader ignoring what this job did not sign (a forged order
neither steers nor crashes anything: docs/operations.md, "Trust boundary")."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from training.contract import Env
from training.contract.orders import (
    IDENTITY_ENV,
    MAX_ORDER_BYTES,
    SECRET_BYTES,
    Assignment,
    OrderError,
    Promotion,
    SecretError,
    Signer,
    create_job_secret,
    load_job_secret,
)
from training.inplace import InPlace

SECRET = b"s" * 32
IDENTITY = {
    Env.RANK: "1",
    Env.WORLD_SIZE: "2",
    Env.LOCAL_RANK: "1",
    Env.LOCAL_WORLD_SIZE: "2",
    Env.GROUP_RANK: "0",
    Env.GROUP_WORLD_SIZE: "1",
    Env.RESTART_COUNT: "0",
    Env.RUN_ID: "digits-ddp-1a2b3c4d",
}


@pytest.fixture(autouse=True)
def _fresh_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no forged key logged yet (a process logs `MAX_LOGGED_KEYS` at most)."""
    from training.contract import orders

    monkeypatch.setattr(orders, "_logged", set())


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]


def _settings(store: Any, **changes: Any) -> InPlace:
    fields: dict[str, Any] = {
        "store_addr": f"127.0.0.1:{store.port}",
        "run_id": "r",
        "restart_count": 0,
        "node_rank": 0,
        "spares": 1,
        "timeout_s": 5.0,
        "secret": SECRET,
    }
    return InPlace(**{**fields, **changes})


# -- the secret ------------------------------------------------------------------------------------------
def test_a_new_secret_is_private_random_and_kept_when_the_run_resumes(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    assert create_job_secret(path) == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_bytes()
    assert len(first) == SECRET_BYTES
    assert create_job_secret(path) == str(path) and path.read_bytes() == first, "a resumed run keeps its secret"
    assert load_job_secret({Env.JOB_SECRET_FILE: str(path)}) == first
    assert create_job_secret(tmp_path / "other") and (tmp_path / "other").read_bytes() != first
    assert load_job_secret({}) is None, "no secret named: the caller decides (in-place recovery is off)"


def test_an_unusable_secret_file_is_one_clear_error(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"x" * (SECRET_BYTES - 1))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # a reader of a FIFO would block: refused without opening it for long
    for path, why in (
        (tmp_path / "missing", "No such file"),
        (tmp_path, "not a regular file"),
        (fifo, "not a regular file"),
        (short, f"at least {SECRET_BYTES} are needed"),
    ):
        with pytest.raises(SecretError, match=f"^{Env.JOB_SECRET_FILE}=.*{why}"):
            load_job_secret({Env.JOB_SECRET_FILE: str(path)})
    with pytest.raises(SecretError):  # an existing bad file is never silently replaced
        create_job_secret(short)
    # A Kubernetes Secret volume's file is a symlink into `..data/`: followed.
    (tmp_path / "data").write_bytes(b"k" * 40)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    assert load_job_secret({Env.JOB_SECRET_FILE: str(tmp_path / "link")}) == b"k" * 40


# -- the MAC ---------------------------------------------------------------------------------------------
def test_an_order_checks_only_under_its_own_key_with_its_own_value_and_secret(caplog: Any) -> None:
    signer = Signer(SECRET)
    raw = signer.sign("torchrig/inplace/r/0/node0/spare0/assign", "{}")
    assert signer.open("torchrig/inplace/r/0/node0/spare0/assign", raw) == "{}"
    assert signer.open("torchrig/inplace/r/0/node0/spare0/assign", raw.encode()) == "{}"
    with caplog.at_level(logging.WARNING, logger="training.contract.orders"):
        for key, forged in (
            ("torchrig/inplace/r/0/node0/spare1/assign", raw),  # another key's
            ("torchrig/inplace/other/0/node0/spare0/assign", raw),  # another run's
            ("torchrig/inplace/r/0/node0/spare0/assign", raw[:-1] + "]"),  # a changed value
            ("torchrig/inplace/r/0/node0/spare0/assign", "{}"),  # no MAC
            ("torchrig/inplace/r/0/node0/spare0/assign", "0" * 64 + ".{}"),  # a MAC made up
            ("torchrig/inplace/r/0/node0/spare0/assign", raw.replace("a", "\u00e9", 1)),  # not ASCII
            ("torchrig/inplace/r/0/node0/spare0/assign", raw + "x" * MAX_ORDER_BYTES),  # huge
        ):
            assert signer.open(key, forged) is None, (key, forged[:80])
        assert Signer(b"t" * 32).open("torchrig/inplace/r/0/node0/spare0/assign", raw) is None, "another job's"
    logged = [r.getMessage() for r in caplog.records]
    assert sum(m.endswith(": torchrig/inplace/r/0/node0/spare0/assign") for m in logged) == 1, "once per key"
    assert all(m.startswith("ignored a store value that is no order of this job") for m in logged)


@settings(max_examples=200, deadline=None)
@given(key=st.text(max_size=80), raw=st.binary(max_size=300))
def test_no_store_value_makes_the_check_raise(key: str, raw: bytes) -> None:
    assert Signer(SECRET).open(key, raw) is None or raw[64:65] == b"."


@settings(max_examples=200, deadline=None)
@given(key=st.text(max_size=80), value=st.text(max_size=200))
def test_whatever_is_signed_opens_to_itself(key: str, value: str) -> None:
    signer = Signer(SECRET)
    assert signer.open(key, signer.sign(key, value).encode()) == value


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    env=st.dictionaries(st.sampled_from([*IDENTITY_ENV, "LD_PRELOAD", "PYTHONPATH", "X"]), _JSON, max_size=10),
    rest=st.dictionaries(st.sampled_from(["generation", "node", "next_spare", "env"]), _JSON, max_size=3),
)
def test_any_json_is_an_order_or_refused_with_one_line(env: dict[str, Any], rest: dict[str, Any]) -> None:
    for parse in (Assignment.parse, Promotion.parse):
        for data in ({"env": env, **rest}, {**rest, "env": {**IDENTITY, **env}}):
            try:
                order = parse(json.dumps(data))
            except OrderError as exc:
                assert "\n" not in str(exc)
            else:  # only a rank's launcher variables, all of them, as strings
                assert set(order.env) == set(IDENTITY_ENV) and all(isinstance(v, str) for v in order.env.values())


# -- the records -----------------------------------------------------------------------------------------
def test_an_assignment_carries_exactly_a_ranks_launcher_variables() -> None:
    good = Assignment(env=IDENTITY, generation=3)
    assert Assignment.parse(good.to_json()) == good
    promotion = Promotion(env=IDENTITY, node=0, next_spare=2)
    assert Promotion.parse(promotion.to_json()) == promotion
    assert set(IDENTITY) == set(IDENTITY_ENV)
    bad: list[tuple[Any, str]] = [
        ({**IDENTITY, "LD_PRELOAD": "/tmp/evil.so"}, "assign.env.LD_PRELOAD: not a launcher variable"),
        ({**IDENTITY, "PYTHONPATH": "/tmp"}, "assign.env.PYTHONPATH: not a launcher variable"),
        ({**IDENTITY, "TORCHRIG_SPEC": "/etc/passwd"}, "assign.env.TORCHRIG_SPEC: not a launcher variable"),
        ({**IDENTITY, Env.RANK: 1}, "assign.env: an entry that is not a string"),
        ({**IDENTITY, Env.RANK: "-1"}, "assign.env.RANK: '-1' is not a non-negative integer"),
        ({**IDENTITY, Env.RANK: "2"}, "assign.env: rank 2 is outside world size 2"),
        ({**IDENTITY, Env.RUN_ID: "../../etc"}, "assign.env.TORCHELASTIC_RUN_ID: '../../etc' is not a run id"),
        ({k: v for k, v in IDENTITY.items() if k != Env.RANK}, "assign.env.RANK: missing"),
        (["RANK=1"], "assign.env: not a map"),
    ]
    for env, message in bad:
        with pytest.raises(OrderError, match=f"^{message}"):
            Assignment.parse(json.dumps({"env": env, "generation": 1}))
    for text, message in (
        ("not json", "assign: not JSON"),
        ("[1]", "assign: not a JSON object"),
        ("[" * 100_000, "assign: "),  # deep nesting: refused, never a RecursionError
        (json.dumps({"env": IDENTITY, "generation": "1"}), "assign.generation: not a non-negative integer"),
        (json.dumps({"env": IDENTITY, "generation": True}), "assign.generation: not a non-negative integer"),
    ):
        with pytest.raises(OrderError, match=f"^{message}"):
            Assignment.parse(text)
    with pytest.raises(OrderError, match=r"^promote\.node: 1 is not the rank's node 0"):
        Promotion.parse(json.dumps({"env": IDENTITY, "node": 1, "next_spare": 0}))


# -- every reader ignores what this job did not sign ------------------------------------------------------
def test_a_spare_ignores_a_forged_assignment_and_takes_its_hosts_own(store: Any, caplog: Any) -> None:
    """The attack of issue 33: a foreign client set `node0/spare0/assign`; the spare took a rank. Now the
    spare logs it once, waits on, and takes the assignment its host signs."""
    from training.inplace.spare import _wait_assignment

    settings = _settings(store)
    client = settings.connect()
    key = settings.spare_key(0, "assign")
    forged_orders = Assignment(env=IDENTITY, generation=5).to_json()
    # Signed, but with a variable no rank is handed: refused (one line) all the same.
    settings.write(client, key, json.dumps({"env": {**IDENTITY, "LD_PRELOAD": "/tmp/x.so"}, "generation": 1}))
    got: list[Assignment] = []
    thread = threading.Thread(target=lambda: got.append(_wait_assignment(settings, settings.connect(), 0)))
    with caplog.at_level(logging.WARNING, logger="training.contract.orders"):
        thread.start()
        time.sleep(0.5)
        assert not got and thread.is_alive(), "the spare neither acts nor crashes"
        client.set(key, forged_orders)  # no MAC
        time.sleep(0.3)
        assert not got, "a forged assignment is no assignment"
        other = _settings(store, run_id="other")  # a signed assignment of another run, replayed here
        client.set(key, other.sign(key, forged_orders))
        time.sleep(0.3)
        assert not got
        client.set(key, "\xff" * 100)  # not JSON
        time.sleep(0.3)
        assert not got and thread.is_alive()
        settings.write(client, key, Assignment(env=IDENTITY, generation=1).to_json())
        thread.join(5)
    assert got == [Assignment(env=IDENTITY, generation=1)]
    assert any("LD_PRELOAD" in r.getMessage() for r in caplog.records)


def test_a_standby_host_ignores_forged_promotion_orders(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from training.inplace.host import _await_promotion

    settings = _settings(store, node_rank=2)
    client = settings.connect()
    for name, value in IDENTITY.items():
        monkeypatch.setenv(name, value)

    class Spare:
        def poll(self) -> int | None:
            return None

        def sleep(self, timeout_s: float) -> None:
            time.sleep(timeout_s)

    key = settings.promote_key(1)
    client.set(key, Promotion(env={**IDENTITY, Env.RANK: "0"}, node=0, next_spare=9).to_json())
    stop_at = time.monotonic() + 1.0
    assert _await_promotion(settings, client, 1, Spare(), lambda: time.monotonic() > stop_at) is None  # type: ignore[arg-type]
    assert os.environ[Env.RANK] == "1", "the forged orders changed nothing"
    settings.write(client, key, Promotion(env=IDENTITY, node=0, next_spare=3).to_json())
    promoted = _await_promotion(settings, client, 1, Spare(), lambda: False)  # type: ignore[arg-type]
    assert promoted is not None and promoted[0].node_rank == 0 and promoted[1] == 3


def test_a_host_claims_no_spare_whose_readiness_is_forged(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged `ready` would have the host watch and signal any pid it names; a forged claim only makes
    that spare unusable (as a deleted key would); a huge forged spawn counter is bounded."""
    from training.inplace.host import claim_spare

    for name, value in IDENTITY.items():
        monkeypatch.setenv(name, value)
    settings = _settings(store, timeout_s=0.3)
    client = settings.connect()
    client.add(settings.spawned_key, 10**12)
    client.set(settings.spare_key(0, "ready"), "1")  # init: never a pid of ours
    settings.write(client, settings.spare_key(1, "ready"), "4242")
    client.set(settings.spare_key(1, "claim"), "0")  # forged claim: spare 1 is unusable
    started = time.monotonic()
    assert claim_spare(settings, client, 1, None) is None
    assert time.monotonic() - started < 5, "the forged counter is bounded"
    assert not client.check([settings.spare_key(0, "assign")])
    settings.write(client, settings.spare_key(2, "ready"), "4343")
    assert claim_spare(settings, client, 1, None) == 4343


def test_a_forged_lost_node_record_does_not_end_a_forming_generation(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.contract import WorkerIdentity
    from training.inplace.group import InPlaceGroup

    created: list[int] = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: created.append(kw["rank"]))
    settings = _settings(store, timeout_s=60.0)
    identity = WorkerIdentity(rank=1, world_size=2, local_rank=1, local_world_size=2)
    group = InPlaceGroup(settings, identity, "gloo")
    client = settings.connect()
    client.set(settings.nodes_lost_key(2), "node(s) [0] stopped beating")  # forged: would end the recovery
    client.set(settings.owner_key(1), "1")  # forged: would make this process stand down
    thread = threading.Thread(target=group.form, args=(2,), daemon=True)
    thread.start()
    time.sleep(0.6)  # past a beat: the member has looked at the lost-node record
    client.add(settings.join_key(2), 1)  # the other member joins
    thread.join(5)
    assert created == [1], "the generation formed as if the forged records were not there"
