"""The placement policy on scripted worker tables: no NATS, no clock."""

from __future__ import annotations

from tokenyard.facilities.tracker import WorkerThrottle
from tokenyard.fleet import WorkerView
from tokenyard.routing.policy import PolicyConfig, RouteInput, choose
from tokenyard.v1 import serving_pb2 as pb

NOW = 100.0
MODEL = "m"


def worker(
    worker_id: str,
    role: str,
    *,
    running: int = 0,
    waiting: int = 0,
    free: int = 100,
    last_seen: float = NOW,
    max_num_seqs: int = 8,
    seq_cap: int = 0,
    model: str = MODEL,
) -> WorkerView:
    hb = pb.WorkerHeartbeat(
        worker_id=worker_id,
        role=role,
        model=model,
        num_running=running,
        num_waiting=waiting,
        num_free_blocks=free,
        num_blocks=100,
        max_num_seqs=max_num_seqs,
        seq_cap=seq_cap,
    )
    return WorkerView(hb, last_seen=last_seen)


def table(*workers: WorkerView) -> dict[str, WorkerView]:
    return {w.worker_id: w for w in workers}


def req(tokens: int = 1000, cached: dict[str, int] | None = None, model: str = MODEL) -> RouteInput:
    return RouteInput("r1", model, tokens, cached or {})


def step_timed(w: WorkerView, fixed_ms: float, ms_per_token: float, queued: int = 0) -> WorkerView:
    hb = pb.WorkerHeartbeat()
    hb.CopyFrom(w.heartbeat)
    hb.step_fixed_ms, hb.step_ms_per_token, hb.pending_prompt_tokens = (
        fixed_ms,
        ms_per_token,
        queued,
    )
    return WorkerView(hb, last_seen=w.last_seen)


def test_idle_pair_keeps_the_request_on_the_prefill_worker():
    # Equal predicted ITL on both: the hand-off would cost and save nothing.
    out = choose(table(worker("p1", "prefill"), worker("d1", "decode")), req(1000), NOW)
    assert isinstance(out, pb.Placement)
    assert (out.prefill_worker_id, out.decode_worker_id, out.disaggregated) == ("p1", "p1", False)
    assert "does not pay" in out.reason


def test_busy_prefill_worker_hands_off_to_an_idle_decode_worker():
    workers = table(worker("p1", "prefill", running=6), worker("d1", "decode", running=1))
    out = choose(workers, RouteInput("r1", MODEL, 100, {}, max_tokens=128), NOW)
    assert isinstance(out, pb.Placement)
    assert (out.prefill_worker_id, out.decode_worker_id, out.disaggregated) == ("p1", "d1", True)
    assert "faster" in out.reason


def test_queued_prompts_on_the_prefill_worker_count_against_decoding_there():
    p = step_timed(worker("p1", "prefill"), 5.0, 1.0, queued=4000)
    d = step_timed(worker("d1", "decode", running=2), 5.0, 1.0)
    out = choose(table(p, d), RouteInput("r1", MODEL, 100, {}, max_tokens=64), NOW)
    assert isinstance(out, pb.Placement) and out.disaggregated


def test_a_short_reply_does_not_pay_for_a_hand_off():
    # Same one-row ITL gap, but over 2 tokens it saves 2 ms against a 10+ ms hand-off.
    workers = table(worker("p1", "prefill", running=1), worker("d1", "decode"))
    out = choose(workers, RouteInput("r1", MODEL, 100, {}, max_tokens=2), NOW)
    assert isinstance(out, pb.Placement) and not out.disaggregated
    longer = choose(workers, RouteInput("r1", MODEL, 100, {}, max_tokens=128), NOW)
    assert isinstance(longer, pb.Placement) and longer.disaggregated


def test_measured_step_times_decide():
    # d1 is measured slower per token (a loaded core): two more rows on p1 still win.
    p = step_timed(worker("p1", "prefill", running=2), 2.0, 1.0)
    d = step_timed(worker("d1", "decode"), 2.0, 4.0)
    out = choose(table(p, d), RouteInput("r1", MODEL, 100, {}, max_tokens=128), NOW)
    assert isinstance(out, pb.Placement) and not out.disaggregated


def test_disaggregation_can_be_forced_either_way():
    workers = table(worker("p1", "prefill"), worker("d1", "decode"))
    out = choose(workers, req(5), NOW, config=PolicyConfig(disaggregation="always"))
    assert isinstance(out, pb.Placement) and out.disaggregated
    busy = table(worker("p1", "prefill", running=7), worker("d1", "decode"))
    out = choose(busy, req(5), NOW, config=PolicyConfig(disaggregation="never"))
    assert isinstance(out, pb.Placement) and not out.disaggregated


def test_no_prefill_worker_is_no_workers():
    out = choose(table(worker("d1", "decode")), req(), NOW)
    assert isinstance(out, pb.RouteError)
    assert out.code == pb.RouteError.NO_WORKERS


def test_empty_fleet_is_no_workers():
    out = choose({}, req(), NOW)
    assert isinstance(out, pb.RouteError) and out.code == pb.RouteError.NO_WORKERS


def test_dead_worker_after_three_missed_beats_is_ignored():
    workers = table(
        worker("p1", "prefill", last_seen=NOW - 3.5), worker("p2", "prefill", last_seen=NOW - 2.5)
    )
    out = choose(workers, req(10), NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p2"
    out = choose(workers, req(10), NOW + 1)
    assert isinstance(out, pb.RouteError) and out.code == pb.RouteError.NO_WORKERS


def test_no_decode_worker_falls_back_to_aggregated():
    out = choose(table(worker("p1", "prefill")), req(1000), NOW)
    assert isinstance(out, pb.Placement)
    assert not out.disaggregated and out.decode_worker_id == "p1"


def test_both_role_worker_serves_alone():
    out = choose(table(worker("b1", "both")), req(1000), NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == out.decode_worker_id == "b1"


def test_least_loaded_prefill_and_decode_win():
    workers = table(
        worker("p1", "prefill", running=6),
        worker("p2", "prefill", running=1),
        worker("d1", "decode", running=7),
        worker("d2", "decode", running=2, waiting=1),
    )
    out = choose(workers, req(), NOW, config=PolicyConfig(disaggregation="always"))
    assert isinstance(out, pb.Placement)
    assert (out.prefill_worker_id, out.decode_worker_id) == ("p2", "d2")


def test_free_blocks_break_equal_queue_depth():
    workers = table(worker("p1", "prefill", free=5), worker("p2", "prefill", free=90))
    out = choose(workers, req(10), NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p2"


def test_prefix_overlap_beats_a_little_load():
    workers = table(worker("p1", "prefill", running=2), worker("p2", "prefill", running=0))
    # p1 holds 60 of the prompt's 64 blocks: worth more than its 2/8 extra load.
    out = choose(
        workers,
        req(1024, cached={"p1": 60}),
        NOW,
        config=PolicyConfig(disaggregation="never"),
    )
    assert isinstance(out, pb.Placement)
    assert out.prefill_worker_id == "p1" and out.expected_cached_tokens == 960


def test_overlap_does_not_beat_a_full_worker():
    workers = table(worker("p1", "prefill", running=8, waiting=8), worker("p2", "prefill"))
    out = choose(workers, req(1024, cached={"p1": 64}), NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p2"


def test_an_overloaded_fleet_sheds_low_priority_requests_first():
    config = PolicyConfig(queue_per_worker=4, low_priority_queue_share=0.5)
    # 8 running (its cap) and 3 waiting: room for 1 more normal request, none of low priority.
    workers = table(worker("p1", "prefill", running=8, waiting=3), worker("d1", "decode"))
    background = RouteInput("r1", MODEL, 1000, {}, priority=5)
    shed = choose(workers, background, NOW, config=config)
    assert isinstance(shed, pb.RouteError) and shed.code == pb.RouteError.OVERLOADED
    for priority in (0, -5):
        placed = choose(
            workers, RouteInput("r2", MODEL, 1000, {}, priority=priority), NOW, config=config
        )
        assert isinstance(placed, pb.Placement), priority
    round_robin = PolicyConfig(queue_per_worker=4, placement="round-robin")
    assert isinstance(choose(workers, background, NOW, config=round_robin), pb.RouteError)


def test_every_worker_full_is_overloaded():
    config = PolicyConfig(queue_per_worker=2)
    workers = table(worker("p1", "prefill", running=8, waiting=2), worker("d1", "decode"))
    out = choose(workers, req(), NOW, config=config)
    assert isinstance(out, pb.RouteError)
    assert out.code == pb.RouteError.OVERLOADED and out.retry_after_s > 0


def test_full_decode_pool_keeps_the_request_on_the_prefill_worker():
    config = PolicyConfig(queue_per_worker=0)
    workers = table(worker("p1", "prefill"), worker("d1", "decode", running=8))
    out = choose(workers, req(), NOW, config=config)
    assert isinstance(out, pb.Placement) and not out.disaggregated


def test_drained_racks_are_skipped_and_all_drained_says_so():
    workers = table(worker("p1", "prefill"), worker("p2", "prefill"), worker("d1", "decode"))
    facilities = {"p1": WorkerThrottle("drain", retry_after_s=20)}
    out = choose(workers, req(10), NOW, facilities=facilities)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p2"
    facilities["p2"] = WorkerThrottle("drain", retry_after_s=40)
    out = choose(workers, req(10), NOW, facilities=facilities)
    assert isinstance(out, pb.RouteError)
    assert out.code == pb.RouteError.ALL_DRAINED and out.retry_after_s == 40


def test_drained_decode_worker_gets_no_new_sequences():
    workers = table(
        worker("p1", "prefill"), worker("d1", "decode"), worker("d2", "decode", running=5)
    )
    always = PolicyConfig(disaggregation="always")  # which decode worker, not whether
    out = choose(workers, req(), NOW, facilities={"d1": WorkerThrottle("drain")}, config=always)
    assert isinstance(out, pb.Placement) and out.decode_worker_id == "d2"


def test_derate_cap_counts_as_load():
    # Equal running counts; p1's rack caps it at 2 sequences, so p1 looks full.
    workers = table(worker("p1", "prefill", running=2), worker("p2", "prefill", running=2))
    out = choose(workers, req(10), NOW, facilities={"p1": WorkerThrottle("derate", seq_cap=2)})
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p2"


def test_heartbeat_seq_cap_is_honoured():
    workers = table(
        worker("p1", "prefill", running=2, seq_cap=2), worker("p2", "prefill", running=3)
    )
    out = choose(workers, req(10), NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p2"


def test_unknown_model():
    out = choose(table(worker("p1", "prefill")), req(model="other"), NOW)
    assert isinstance(out, pb.RouteError) and out.code == pb.RouteError.UNKNOWN_MODEL
    assert "other" in out.message


def test_empty_model_matches_any():
    out = choose(table(worker("p1", "prefill")), req(model=""), NOW)
    assert isinstance(out, pb.Placement)


def test_ties_go_to_the_smallest_id():
    workers = table(worker("p2", "prefill"), worker("p1", "prefill"))
    out = choose(workers, req(10), NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p1"


def test_derate_cost_penalty_sends_equal_work_to_the_healthy_rack():
    # p1 sorts first on ties; its rack's derate penalty must tip the choice to p2.
    workers = table(worker("p1", "prefill", running=1), worker("p2", "prefill", running=1))
    derated = {"p1": WorkerThrottle("derate", seq_cap=8, cost_penalty=0.5)}
    out = choose(workers, req(10), NOW, facilities=derated)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p2"
    out = choose(workers, req(10), NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p1"


def test_derated_worker_still_serves_when_it_is_the_better_one():
    # The penalty is a cost, not a ban: a much busier healthy worker still loses.
    workers = table(worker("p1", "prefill"), worker("p2", "prefill", running=8))
    derated = {"p1": WorkerThrottle("derate", seq_cap=8, cost_penalty=0.5)}
    out = choose(workers, req(10), NOW, facilities=derated)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p1"


def test_drained_worker_gets_nothing_even_when_idle():
    workers = table(
        worker("p1", "prefill"),
        worker("p2", "prefill", running=7),
        worker("d1", "decode"),
        worker("d2", "decode", running=7),
    )
    facilities = {
        "p1": WorkerThrottle("drain"),
        "d1": WorkerThrottle("drain"),
        "p2": WorkerThrottle("derate", seq_cap=8, cost_penalty=0.5),
    }
    always = PolicyConfig(disaggregation="always")  # which decode worker, not whether
    out = choose(workers, req(), NOW, facilities=facilities, config=always)
    assert isinstance(out, pb.Placement)
    assert (out.prefill_worker_id, out.decode_worker_id) == ("p2", "d2")


def local(w: WorkerView) -> WorkerView:
    hb = pb.WorkerHeartbeat()
    hb.CopyFrom(w.heartbeat)
    hb.local_prefill = True
    return WorkerView(hb, last_seen=w.last_seen)


def test_a_decode_worker_with_local_prefill_runs_whole_requests_when_less_busy():
    workers = table(worker("p1", "prefill", running=5), local(worker("d1", "decode", running=1)))
    out = choose(workers, req(100), NOW)
    assert isinstance(out, pb.Placement)
    assert (out.prefill_worker_id, out.decode_worker_id, out.disaggregated) == ("d1", "d1", False)
    assert "decode worker runs the whole request" in out.reason


def test_local_prefill_is_not_used_when_disaggregation_is_forced():
    workers = table(worker("p1", "prefill", running=5), local(worker("d1", "decode", running=1)))
    out = choose(workers, req(100), NOW, config=PolicyConfig(disaggregation="always"))
    assert isinstance(out, pb.Placement)
    assert (out.prefill_worker_id, out.decode_worker_id, out.disaggregated) == ("p1", "d1", True)


def test_without_local_prefill_a_decode_worker_never_takes_the_prompt():
    workers = table(worker("p1", "prefill", running=5), worker("d1", "decode", running=0))
    out = choose(workers, req(100), NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "p1"


def not_ready(w: WorkerView, reason: str) -> WorkerView:
    hb = pb.WorkerHeartbeat()
    hb.CopyFrom(w.heartbeat)
    hb.not_ready = reason
    return WorkerView(hb, last_seen=w.last_seen)


def test_a_worker_that_says_it_cannot_take_work_gets_none():
    stuck = not_ready(worker("p1", "prefill"), "the engine has not answered for 75 s")
    fine = worker("p2", "prefill", running=7)  # busy, but able
    placed = choose(table(stuck, fine, worker("d1", "decode")), req(), NOW)
    assert isinstance(placed, pb.Placement) and placed.prefill_worker_id == "p2"
    alone = choose(table(stuck, worker("d1", "decode")), req(), NOW)
    assert isinstance(alone, pb.RouteError) and alone.code == pb.RouteError.NO_WORKERS


def drained(w: WorkerView) -> WorkerView:
    hb = pb.WorkerHeartbeat()
    hb.CopyFrom(w.heartbeat)
    hb.draining = True
    return WorkerView(hb, last_seen=w.last_seen)


def test_a_drained_worker_gets_nothing_new_even_when_idle():
    workers = table(drained(worker("b1", "both")), worker("b2", "both", running=7))
    out = choose(workers, req(100), NOW)
    assert isinstance(out, pb.Placement)
    assert (out.prefill_worker_id, out.decode_worker_id) == ("b2", "b2")


def test_a_drained_decode_worker_is_no_hand_off_target():
    workers = table(
        worker("p1", "prefill", running=6),
        drained(worker("d1", "decode")),
        worker("d2", "decode", running=5),
    )
    out = choose(workers, RouteInput("r1", MODEL, 100, {}, max_tokens=128), NOW)
    assert isinstance(out, pb.Placement) and out.decode_worker_id != "d1"


def test_every_worker_drained_is_a_route_error():
    out = choose(table(drained(worker("b1", "both"))), req(100), NOW)
    assert isinstance(out, pb.RouteError) and out.code == pb.RouteError.ALL_DRAINED
    assert "drained by an operator" in out.message and out.retry_after_s > 0


def test_power_pressure_shares_new_work_out_by_headroom_not_all_to_one_rack() -> None:
    """A load weight (not a fixed penalty): the cooler rack takes more, not everything."""
    from tokenyard.fleet import FleetView
    from tokenyard.routing.policy import PolicyConfig, RouteInput, choose
    from tokenyard.v1 import serving_pb2 as pb

    fleet = FleetView()
    for wid in ("both-hot", "both-cool"):
        fleet.on_heartbeat(pb.WorkerHeartbeat(worker_id=wid, role="both", max_num_seqs=32,
                                              num_blocks=100, num_free_blocks=100,
                                              heartbeat_interval_ms=1000), 0.0)  # fmt: skip
    facilities = {"both-hot": WorkerThrottle(load_weight=3.0), "both-cool": WorkerThrottle()}
    placed = []
    for i in range(40):
        p = choose(fleet.workers, RouteInput(str(i), "", 16), 0.5, facilities=facilities,
                   config=PolicyConfig(disaggregation="never"))  # fmt: skip
        assert isinstance(p, pb.Placement)
        fleet.placed(p.prefill_worker_id)
        placed.append(p.prefill_worker_id)
    assert placed.count("both-cool") == 30 and placed.count("both-hot") == 10


def test_round_robin_takes_the_workers_in_turn_whatever_they_hold():
    workers = table(worker("b", "both"), worker("a", "both"), worker("c", "both", running=8))
    held = {"b": 10}  # the whole prompt cached on b: kv-aware sends every turn there

    def turns(config: PolicyConfig) -> list[str]:
        chosen = []
        for turn in range(4):
            r = RouteInput(f"r{turn}", MODEL, 160, held, turn=turn)
            placement = choose(workers, r, NOW, config=config)
            assert isinstance(placement, pb.Placement)
            chosen.append(placement.prefill_worker_id)
        return chosen

    assert turns(PolicyConfig(placement="round-robin")) == ["a", "b", "c", "a"]
    # c at its cap with no queue allowed has no room: the turn passes to the others.
    full = PolicyConfig(placement="round-robin", queue_per_worker=0)
    assert turns(full) == ["a", "b", "a", "b"]
    assert turns(PolicyConfig()) == ["b", "b", "b", "b"]


def with_context(w: WorkerView, max_model_len: int) -> WorkerView:
    hb = pb.WorkerHeartbeat()
    hb.CopyFrom(w.heartbeat)
    hb.max_model_len = max_model_len
    return WorkerView(hb, last_seen=w.last_seen)


def test_a_worker_claiming_a_short_context_gets_no_longer_request_and_the_others_serve_it():
    liar = with_context(worker("a", "both"), 1)  # idle, so it would win on load alone
    honest = with_context(worker("b", "both", running=3), 4096)
    workers = table(liar, honest)
    request = RouteInput("r1", MODEL, 1000, max_tokens=100)
    placed = choose(workers, request, NOW)
    assert isinstance(placed, pb.Placement) and placed.prefill_worker_id == "b"
    # A request that fits the short context may still go to it.
    short = choose(workers, RouteInput("r2", MODEL, 0, max_tokens=1), NOW)
    assert isinstance(short, pb.Placement) and short.prefill_worker_id == "a"
    # Longer than every worker's context: a clear error naming the longest.
    too_long = choose(workers, RouteInput("r3", MODEL, 4000, max_tokens=200), NOW)
    assert isinstance(too_long, pb.RouteError)
    assert too_long.code == pb.RouteError.CONTEXT_TOO_LONG and "4096" in too_long.message


# --- the shared KV-cache tier ---------------------------------------------------------------


def pooled(w: WorkerView, fetch_ms_per_block: float = 0.0, ms_per_token: float = 0.0) -> WorkerView:
    """``w`` with a KV pool (so it can fetch from the shared tier) and measured costs."""
    from tokenyard.v1 import kv_pb2

    hb = pb.WorkerHeartbeat()
    hb.CopyFrom(w.heartbeat)
    hb.kv_layout.CopyFrom(kv_pb2.KVLayoutDesc(model_id=MODEL, block_size=16))
    hb.kvcache_fetch_ms_per_block = fetch_ms_per_block
    hb.step_ms_per_token = ms_per_token
    return WorkerView(hb, last_seen=w.last_seen)


def shared_req(cached: dict[str, int], shared_blocks: int, tokens: int = 1600) -> RouteInput:
    return RouteInput("r1", MODEL, tokens, cached, shared_blocks=shared_blocks)


def test_a_shared_hit_shrinks_a_busy_local_holders_lead():
    # a holds half the prompt and is busier; b holds nothing. Without the shared
    # tier a's hit wins; with all of it in the shared tier, b (idle) fetches it instead.
    workers = table(pooled(worker("a", "both", running=4)), pooled(worker("b", "both", running=1)))
    cfg = PolicyConfig(disaggregation="never")
    alone = choose(workers, shared_req({"a": 50}, 0), NOW, config=cfg)
    assert alone.prefill_worker_id == "a"
    shared = choose(workers, shared_req({"a": 50}, 100), NOW, config=cfg)
    assert shared.prefill_worker_id == "b"
    assert shared.expected_cached_tokens == 1600  # fetched, not computed


def test_an_equal_local_hit_beats_a_pull():
    workers = table(pooled(worker("a", "both")), pooled(worker("b", "both")))
    cfg = PolicyConfig(disaggregation="never")
    # b is first by id on a tie; a holds the prompt itself, b would have to pull it.
    result = choose(workers, shared_req({"a": 100}, 100), NOW, config=cfg)
    assert result.prefill_worker_id == "a"


def test_a_pull_is_priced_by_the_workers_measured_costs():
    # b's fetch costs as much as computing the tokens: its shared hit is worth nothing,
    # so a's small local hit wins; c fetches at a tenth of its compute cost and wins.
    cfg = PolicyConfig(disaggregation="never")
    a = pooled(worker("a", "both"), fetch_ms_per_block=16.0, ms_per_token=1.0)
    b = pooled(worker("b", "both"), fetch_ms_per_block=16.0, ms_per_token=1.0)
    c = pooled(worker("c", "both"), fetch_ms_per_block=1.6, ms_per_token=1.0)
    assert choose(table(a, b), shared_req({"a": 10}, 100), NOW, config=cfg).prefill_worker_id == "a"
    assert choose(table(a, c), shared_req({"a": 10}, 100), NOW, config=cfg).prefill_worker_id == "c"


def test_a_worker_without_a_pool_gets_no_credit_for_the_shared_tier():
    workers = table(worker("a", "both"), pooled(worker("b", "both", running=2)))
    result = choose(workers, shared_req({}, 100), NOW, config=PolicyConfig(disaggregation="never"))
    assert result.prefill_worker_id == "b"


def test_a_lora_request_goes_only_to_a_worker_holding_the_adapter():
    holder = worker("b2", "both", running=6)
    holder.heartbeat.lora_adapters.append("sql")
    workers = table(worker("b1", "both"), holder)
    request = RouteInput("r1", MODEL, 100, {}, lora="sql")
    out = choose(workers, request, NOW)  # b1 is idle, but holds no adapter
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "b2"
    assert out.decode_worker_id == "b2"
    out = choose(workers, RouteInput("r1", MODEL, 100, {}, lora="other"), NOW)
    assert isinstance(out, pb.RouteError) and out.code == pb.RouteError.UNKNOWN_MODEL
    assert "'other' is loaded on no live worker" in out.message
