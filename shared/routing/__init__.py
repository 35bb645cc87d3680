"""Request placement: the router's pure policy (`choose`) and its disaggregation cost model.

    choose(fleet.workers, RouteInput(rid, model, n_prompt), now, facilities=racks.by_worker())

No bus and no clock: the router service feeds it from NATS, the simulator from its events.
"""
