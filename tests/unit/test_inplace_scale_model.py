"""The latency model of `bench/sections/inplace_scale.py` (no store, no socket: its calibration runs in
the bench only)."""

from __future__ import annotations

from bench.sections.inplace_scale import StoreCosts, dedicated_costs, markdown, model_recovery, mttr_table

COSTS = StoreCosts(service_s=20e-6, rtt_s=100e-6, multi_get_per_key_s=5e-6, connect_s=2e-3, wake_s=20e-6)


def test_the_spare_is_the_last_to_join_and_the_store_part_ends_with_the_nccl_id() -> None:
    rec = model_recovery(64, COSTS)
    assert rec.fell_back is None
    assert rec.host_assigned_s < rec.spare_joined_s == rec.last_join_s <= rec.last_woken_s < rec.store_done_s
    # 64 members: owner, generation, join, formed wait, NCCL id; two wakes each but the last joiner's.
    assert 64 * 5 <= rec.requests <= 64 * 8


def test_the_survivors_joins_queue_the_hosts_claim_behind_them() -> None:
    small, large = model_recovery(64, COSTS, background=False), model_recovery(4096, COSTS, background=False)
    assert large.host_assigned_s > 20 * small.host_assigned_s  # each of its requests waits behind the joins
    assert large.store_done_s > 4096 * 3 * COSTS.service_s  # at least the joins, one after the other


def test_a_store_busier_than_it_can_serve_is_reported_saturated_not_timed() -> None:
    slow = StoreCosts(service_s=300e-6, rtt_s=100e-6, multi_get_per_key_s=5e-6, connect_s=2e-3, wake_s=300e-6)
    rec = model_recovery(8000, slow)  # 16,000 background requests a second at 300 µs each: 480% busy
    assert rec.utilisation_before > 1
    assert rec.fell_back is not None and "saturated" in rec.fell_back
    assert mttr_table(slow, (8000,))[0]["mttr_s"] is None


def test_the_table_renders_both_stores() -> None:
    model = {
        "this_machine": mttr_table(COSTS, (64,)),
        "dedicated_store_core": mttr_table(dedicated_costs(COSTS), (64,)),
    }
    results = {
        "inplace_scale": {
            "model": model,
            "simulator": {
                "schedules_per_minute": 12000.0,
                "target_per_minute": 10000,
                "cpu_share": 0.5,
                "schedules_per_cpu_minute": 24000.0,
                "outcomes_of_2000_seeded": {"resumed": 2000},
            },
            "calibration": {"costs": COSTS.__dict__, "measured": {"wake_32_s": 0.001}},
        }
    }
    text = "\n".join(markdown(results))
    assert "| 64 | this machine |" in text and "| 64 | own core, 100k/s |" in text
    assert "12,000 schedules/minute" in text
    assert markdown({}) == []
