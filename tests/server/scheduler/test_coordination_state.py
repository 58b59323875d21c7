"""`Coordination` alone: messages in, effects out, no sockets and no clock.

Each test feeds the state plain messages (as a client's would decode) and asserts the
exact replies, the task keys held and dropped, and that refused input changes nothing.
"""
import copy

import pytest

from distributed_server.scheduler.coordination import OPS, Coordination, CoordinationLimits

KNOWN = {"k1", "k2", ("x", 0)}


def make(**limits) -> Coordination:
    return Coordination(KNOWN.__contains__, CoordinationLimits(**limits))


class Driver:
    """Sends messages to a Coordination with increasing request ids."""

    def __init__(self, coord: Coordination) -> None:
        self.coord = coord
        self.reqid = 0
        self.now = 100.0

    def __call__(self, client: str, op: str, **fields) -> list:
        self.reqid += 1
        return self.raw(client, {"op": op, "reqid": self.reqid, **fields})

    def raw(self, client: str, msg: dict) -> list:
        effects = self.coord.handle(client, msg, self.now)
        self.coord.validate()
        return effects


def replies(effects: list) -> list:
    """``[(client, result or error)]`` of the sends, in order."""
    return [(e[1], e[2].get("result", e[2].get("error"))) for e in effects if e[0] == "send"]


def keys_effects(effects: list) -> list:
    return [(e[0], sorted(map(str, e[1]))) for e in effects if e[0] != "send"]


def snapshot(coord: Coordination) -> dict:
    """Everything the state holds, comparable (for 'a refusal changed nothing')."""
    return copy.deepcopy({
        "variables": {n: (bytes(v.data), v.keys) for n, v in coord.variables.items()},
        "queues": {n: ([bytes(v.data) for v in q.items], q.maxsize, sorted(q.getters),
                       sorted(q.putters)) for n, q in coord.queues.items()},
        "locks": {n: dict(p.leases) for n, p in coord.locks.items()},
        "semaphores": {n: (p.max_leases, dict(p.leases)) for n, p in coord.semaphores.items()},
        "events": {n: (e.is_set, sorted(e.waiters)) for n, e in coord.events.items()},
        "topics": {n: sorted(s) for n, s in coord.topics.items()},
        "held": dict(coord.held), "bytes": coord.total_bytes,
        "waiting": {c: sorted(r.waiting) for c, r in coord.clients.items()},
    })


def test_ops_are_the_documented_ones():
    assert OPS == {
        "variable-set", "variable-get", "variable-delete", "queue-put", "queue-get",
        "queue-qsize", "lock-acquire", "lock-release", "lock-locked", "semaphore-acquire",
        "semaphore-release", "semaphore-value", "event-set", "event-clear", "event-wait",
        "event-is-set", "pub-put", "sub-subscribe", "sub-get", "sub-unsubscribe",
        "value-received", "abandon-request"}


def test_a_variable_get_waits_for_the_set_and_holds_its_keys_until_received():
    coord = make()
    send = Driver(coord)
    assert send("b", "variable-get", name="v") == []  # parked
    effects = send("a", "variable-set", name="v", value=b"p", keys=["k1"])
    assert replies(effects) == [("b", {"status": "ok", "value": b"p", "handoff": 0}),
                                ("a", {"status": "ok"})]
    assert keys_effects(effects) == [("hold", ["k1"])]
    assert coord.held == {"k1": 2}  # the variable, and the handoff to b
    assert keys_effects(send("a", "variable-delete", name="v")) == []  # still handed off
    assert keys_effects(send.raw("b", {"op": "value-received", "handoff": 0})) == [
        ("drop", ["k1"])]
    assert coord.held == {} and coord.total_bytes == 0


def test_overwriting_a_variable_swaps_the_held_keys_without_dropping_shared_ones():
    coord = make()
    send = Driver(coord)
    send("a", "variable-set", name="v", value=b"1", keys=["k1", "k2"])
    effects = send("a", "variable-set", name="v", value=b"2", keys=["k2"])
    assert keys_effects(effects) == [("drop", ["k1"])]
    assert coord.held == {"k2": 1} and coord.total_bytes == 1


def test_a_parked_request_times_out_at_its_deadline():
    coord = make()
    send = Driver(coord)
    assert send("b", "variable-get", name="v", timeout=2.5) == []
    assert coord.next_deadline() == 102.5
    assert coord.expire(102.4) == []
    assert replies(coord.expire(102.5)) == [("b", {"status": "timed-out"})]
    coord.validate()
    assert coord.next_deadline() is None and not coord.variable_waiters
    assert replies(send("b", "variable-get", name="v", timeout=0)) == [
        ("b", {"status": "timed-out"})]


def test_queue_items_go_first_in_first_out_and_batches_take_what_is_there():
    coord = make()
    send = Driver(coord)
    for i in range(3):
        send("a", "queue-put", name="q", value=bytes([i]))
    assert replies(send("b", "queue-get", name="q")) == [("b", {"status": "ok", "value": b"\0"})]
    assert replies(send("b", "queue-qsize", name="q")) == [("b", {"status": "ok", "size": 2})]
    assert replies(send("b", "queue-get", name="q", batch=True)) == [
        ("b", {"status": "ok", "values": [b"\1", b"\2"]})]
    assert not coord.queues  # empty and nobody waiting: forgotten
    assert replies(send("b", "queue-get", name="q", batch=True)) == [
        ("b", {"status": "ok", "values": []})]


def test_a_bounded_queue_parks_putters_and_admits_them_as_items_leave():
    coord = make()
    send = Driver(coord)
    send("a", "queue-put", name="q", value=b"1", maxsize=1)
    assert send("a", "queue-put", name="q", value=b"2", maxsize=1, keys=["k1"]) == [
        ("hold", ["k1"])]  # parked, its value held meanwhile
    putter = send.reqid
    assert replies(send("a", "queue-put", name="q", value=b"3", maxsize=1, timeout=0)) == [
        ("a", {"status": "timed-out"})]
    effects = send("b", "queue-get", name="q")
    assert replies(effects) == [("b", {"status": "ok", "value": b"1"}),
                                ("a", {"status": "ok"})]
    assert effects[1][2]["reqid"] == putter
    assert [bytes(v.data) for v in coord.queues["q"].items] == [b"2"]


def test_a_batch_getter_is_served_once_enough_items_are_there():
    coord = make()
    send = Driver(coord)
    assert send("b", "queue-get", name="q", batch=2) == []
    assert replies(send("a", "queue-put", name="q", value=b"1")) == [("a", {"status": "ok"})]
    assert replies(send("a", "queue-put", name="q", value=b"2")) == [
        ("a", {"status": "ok"}), ("b", {"status": "ok", "values": [b"1", b"2"]})]


def test_an_unbounded_queue_refuses_items_past_its_limit():
    coord = make(max_queue_items=2)
    send = Driver(coord)
    send("a", "queue-put", name="q", value=b"1")
    send("a", "queue-put", name="q", value=b"2")
    before = snapshot(coord)
    [(client, error)] = replies(send("a", "queue-put", name="q", value=b"3"))
    assert "holds 2 items, the most a queue may hold" in error
    assert snapshot(coord) == before


def test_the_lock_goes_to_waiters_in_order_and_a_departed_client_releases_it():
    coord = make()
    send = Driver(coord)
    assert replies(send("a", "lock-acquire", name="L", holder="h1")) == [("a", {"status": "ok"})]
    assert send("b", "lock-acquire", name="L", holder="h2") == []
    assert send("c", "lock-acquire", name="L", holder="h3") == []
    b_request = send.reqid - 1
    effects = coord.client_gone("a")
    coord.validate()
    assert effects == [("send", "b", {"op": "reply", "reqid": b_request,
                                      "result": {"status": "ok"}})]
    assert replies(send("c", "lock-locked", name="L")) == [
        ("c", {"status": "ok", "locked": True})]
    coord.client_gone("c")  # its parked request goes with it
    assert replies(send("b", "lock-release", name="L", holder="h2"))[0][1] == {"status": "ok"}
    assert not coord.locks and not any(r.waiting for r in coord.clients.values())


def test_only_the_holder_may_release_a_lock():
    coord = make()
    send = Driver(coord)
    send("a", "lock-acquire", name="L", holder="h1")
    before = snapshot(coord)
    for client, holder in (("a", "other"), ("b", "h1")):
        [(_, error)] = replies(send(client, "lock-release", name="L", holder=holder))
        assert "release without acquire" in error
    assert snapshot(coord) == before


def test_semaphore_leases_and_their_count():
    coord = make()
    send = Driver(coord)
    for holder in ("h1", "h1"):
        assert replies(send("a", "semaphore-acquire", name="s", holder=holder, max_leases=2))[0][1] \
            == {"status": "ok"}
    assert replies(send("b", "semaphore-acquire", name="s", holder="h2", max_leases=2,
                        timeout=0))[0][1] == {"status": "timed-out"}
    assert replies(send("b", "semaphore-value", name="s"))[0][1] == {"status": "ok", "value": 2}
    [(_, error)] = replies(send("b", "semaphore-acquire", name="s", holder="h2", max_leases=3))
    assert "has max_leases=2, not 3" in error
    send("a", "semaphore-release", name="s", holder="h1")
    assert replies(send("b", "semaphore-value", name="s"))[0][1]["value"] == 1


def test_an_event_wakes_every_waiter_and_is_forgotten_once_cleared():
    coord = make()
    send = Driver(coord)
    send("a", "event-wait", name="e")
    send("b", "event-wait", name="e", timeout=5)
    effects = send("c", "event-set", name="e")
    assert [c for c, _ in replies(effects)] == ["a", "b", "c"]
    assert coord.next_deadline() is None
    assert replies(send("a", "event-wait", name="e", timeout=0))[0][1] == {"status": "ok"}
    send("a", "event-clear", name="e")
    assert not coord.events


def test_pub_sub_delivers_to_subscriptions_that_exist_and_drops_the_oldest_past_the_buffer():
    coord = make(max_sub_buffer=2)
    send = Driver(coord)
    send("a", "pub-put", name="t", value=b"lost")  # nobody listens
    send("b", "sub-subscribe", name="t", sub_id=7)
    for i in range(3):
        send.raw("a", {"op": "pub-put", "name": "t", "value": bytes([i])})
    assert replies(send("b", "sub-get", sub_id=7))[0][1] == {"status": "ok", "value": b"\1",
                                                            "dropped": 1}
    assert send("b", "sub-get", sub_id=7)[0][2]["result"]["dropped"] == 0
    assert send("b", "sub-get", sub_id=7) == []  # parked
    effects = send.raw("b", {"op": "sub-unsubscribe", "sub_id": 7})
    assert replies(effects) == [("b", {"status": "closed"})]
    assert not coord.topics and coord.total_bytes == 0


def test_an_abandoned_request_is_answered_and_forgotten():
    coord = make()
    send = Driver(coord)
    send("a", "lock-acquire", name="L", holder="h1")
    send("b", "lock-acquire", name="L", holder="h2")
    effects = send.raw("b", {"op": "abandon-request", "reqid": send.reqid})
    assert replies(effects) == [("b", {"status": "abandoned"})]
    assert not coord.locks["L"].waiters


@pytest.mark.parametrize("msg, text", [
    ({"op": "variable-set", "reqid": 1, "name": 3, "value": b"x"}, "name must be a str"),
    ({"op": "variable-set", "reqid": 1, "name": "", "value": b"x"}, "name must be a str"),
    ({"op": "variable-set", "reqid": 1, "name": "v", "value": "text"}, "must be bytes"),
    ({"op": "variable-set", "reqid": 1, "name": "v", "value": b"x", "keys": ["gone"]},
     "does not know"),
    ({"op": "variable-set", "reqid": 1, "name": "v", "value": b"x", "keys": [{}]},
     "hashable"),
    ({"op": "variable-set", "reqid": 1, "name": "v", "value": b"x" * 101}, "at most 100"),
    ({"op": "variable-get", "reqid": 1, "name": "v", "timeout": -1}, "timeout must be"),
    ({"op": "variable-get", "reqid": 1, "name": "v", "timeout": "1s"}, "timeout must be"),
    ({"op": "variable-get", "reqid": "one", "name": "v"}, "needs an int 'reqid'"),
    ({"op": "queue-put", "reqid": 1, "name": "q", "value": b"x", "maxsize": -1}, "maxsize"),
    ({"op": "queue-get", "reqid": 1, "name": "q", "batch": 0}, "batch must be"),
    ({"op": "semaphore-acquire", "reqid": 1, "name": {}, "holder": "h"}, "name must be"),
    ({"op": "semaphore-acquire", "reqid": 1, "name": "s", "holder": "h", "max_leases": 0},
     "max_leases"),
    ({"op": "lock-acquire", "reqid": 1, "name": "L", "holder": 5}, "'holder' must be"),
    ({"op": "sub-get", "reqid": 1, "sub_id": 1}, "no subscription"),
    ({"op": "sub-subscribe", "reqid": 1, "name": "t", "sub_id": [1]}, "int 'sub_id'"),
    ({"op": "value-received", "handoff": {}}, "int 'handoff'"),
    ({"op": "abandon-request", "reqid": {}}, "int 'reqid'"),
    ({"op": "pub-put", "name": "t", "value": None}, "must be bytes"),
])
def test_bad_input_is_refused_with_a_clear_error_and_changes_nothing(msg, text):
    coord = make(max_value_bytes=100)
    send = Driver(coord)
    send("a", "variable-set", name="v", value=b"old", keys=["k1"])
    send("a", "lock-acquire", name="L", holder="h")
    send("a", "sub-subscribe", name="t", sub_id=0)
    send("c", "event-wait", name="e")
    before = snapshot(coord)
    [(kind, client, reply)] = coord.handle("c", msg, 200.0)
    assert kind == "send" and client == "c"
    assert text in reply["error"], reply
    assert reply["op"] == ("reply" if type(msg.get("reqid")) is int else "error")
    assert snapshot(coord) == before


def test_limits_on_names_bytes_waiting_and_subscriptions_refuse_and_change_nothing():
    coord = make(max_names=2, max_total_bytes=10, max_waiting_per_client=1,
                 max_subscriptions_per_client=1)
    send = Driver(coord)
    send("a", "variable-set", name="v1", value=b"12345")
    send("a", "variable-set", name="v2", value=b"123")
    send("a", "variable-get", name="nothing")
    send("a", "sub-subscribe", name="t", sub_id=1)
    before = snapshot(coord)
    cases = [
        (dict(op="variable-set", name="v3", value=b"1"), "holds 2 variables, the most"),
        (dict(op="variable-set", name="v1", value=b"12345678"), "does not fit"),
        (dict(op="queue-put", name="q", value=b"123"), "does not fit"),
        (dict(op="event-wait", name="e"), "requests waiting, the most"),
        (dict(op="sub-subscribe", name="t", sub_id=2), "subscriptions, the most"),
    ]
    for fields, text in cases:
        [(_, error)] = replies(send("a", **fields))
        assert text in error, (fields, error)
    assert snapshot(coord) == before
    # replacing a value frees its bytes first
    assert replies(send("a", "variable-set", name="v1", value=b"1234567"))[0][1] == {
        "status": "ok"}


def test_a_departed_client_leaves_nothing_behind():
    coord = make()
    send = Driver(coord)
    send("b", "lock-acquire", name="L", holder="h")
    send("b", "semaphore-acquire", name="s", holder="h", max_leases=1)
    send("b", "queue-put", name="q", value=b"1", maxsize=1, keys=["k1"])
    send("b", "queue-put", name="q", value=b"2", maxsize=1, keys=[("x", 0)])  # parked
    send("b", "queue-get", name="other")
    send("b", "sub-subscribe", name="t", sub_id=1)
    send.raw("a", {"op": "pub-put", "name": "t", "value": b"m", "keys": ["k2"]})
    send("a", "variable-set", name="v", value=b"v", keys=["k2"])
    send("b", "variable-get", name="v")  # an unconfirmed handoff
    effects = coord.client_gone("b")
    coord.validate()
    assert keys_effects(effects) == [("drop", ["('x', 0)"])]  # k1 stays queued
    assert coord.held == {"k1": 1, "k2": 1}
    assert set(coord.queues) == {"q"} and not coord.locks and not coord.semaphores
    assert not coord.topics and "b" not in coord.clients


def test_after_a_restart_values_hold_only_keys_still_wanted():
    coord = make()
    send = Driver(coord)
    send("a", "variable-set", name="v", value=b"v", keys=["k1", "k2"])
    coord.keys_lost({"k2"})
    assert coord.variables["v"].keys == ("k2",) and coord.held == {"k2": 1}
    assert keys_effects(send("a", "variable-delete", name="v")) == [("drop", ["k2"])]
