"""The controller's garbage-collector pauses: timed by phase, full collections counted, forgotten at each take."""

from __future__ import annotations

import gc

from hybridrl.run.gc_pauses import GcPauses


def test_a_pause_is_counted_in_the_phase_it_fell_in_and_a_take_starts_afresh() -> None:
    now = iter([1.0, 1.25, 2.0, 2.5, 3.0, 3.125])
    pauses = GcPauses(clock=lambda: next(now))
    pauses.set_phase("gen")
    pauses.on_collect("start", {"generation": 0})
    pauses.on_collect("stop", {"generation": 0})  # 0.25 s in the rollout
    pauses.set_phase("update_actor")
    pauses.on_collect("start", {"generation": 2})
    pauses.on_collect("stop", {"generation": 2})  # 0.5 s, a full one, in training
    assert pauses.take() == {"host/gc_pause_s": 0.75, "host/gc_pause_s_gen": 0.25, "host/gc_full_collections": 1}
    pauses.on_collect("start", {"generation": 1})
    pauses.on_collect("stop", {"generation": 1})
    assert pauses.take() == {"host/gc_pause_s": 0.125, "host/gc_pause_s_gen": 0.0, "host/gc_full_collections": 0}


def test_a_stop_whose_start_was_not_seen_counts_nothing() -> None:
    pauses = GcPauses(clock=lambda: 5.0)
    pauses.on_collect("stop", {"generation": 2})  # installed while a collection ran
    assert pauses.take() == {"host/gc_pause_s": 0.0, "host/gc_pause_s_gen": 0.0, "host/gc_full_collections": 0}


def test_real_collections_are_seen_while_started_and_not_after_close() -> None:
    pauses = GcPauses().start()
    try:
        pauses.set_phase("gen")
        for _ in range(2000):  # cycles only the collector frees
            a: list = []
            a.append(a)
        gc.collect()  # a full collection
        got = pauses.take()
        assert got["host/gc_full_collections"] >= 1 and got["host/gc_pause_s_gen"] > 0
        assert got["host/gc_pause_s"] >= got["host/gc_pause_s_gen"]
    finally:
        pauses.close()
    assert pauses.on_collect not in gc.callbacks
    gc.collect()
    assert pauses.take()["host/gc_full_collections"] == 0
