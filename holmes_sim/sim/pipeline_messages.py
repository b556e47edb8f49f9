"""The engine's point-to-point messages between pipeline stages: one micro-batch's activation
(forward) or gradient (backward), sent when the producing op ends and consumed by the next
virtual stage's op of the same kind and micro-batch.

A transfer is a rendezvous, as NCCL and gloo run it: it starts when the sender has sent and the
receiver has posted its receive, whichever comes later; its arrival event fires when the last
byte is in, and the sender's `pp-send` row is recorded then. Messages are numbered (`local_id`
within a replica, `base` per simulated replica) and their state kept in lists indexed by
number, so the engine's hot loop looks them up without hashing tuples. The replicas' messages
of one (kind, virtual stage, micro-batch) are adjacent: replicas run alike, so the messages
touched one after another at an instant share cache lines.
"""

from __future__ import annotations

from holmes_sim.sim.environment import CountingEnvironment, LeanEvent
from holmes_sim.sim.network import FlowNetwork
from holmes_sim.sim.trace import KIND_CODE, OpKind, append_row
from holmes_sim.version import extension

_PP_SEND = KIND_CODE[OpKind.PP_SEND]
POSTED = object()
"""A message's state: its receive is posted and nothing was sent yet."""
STARTED = object()
"""A message's state: its transfer has started."""


class PipelineMessages:
    """Every message of a simulation: per number its state (None: neither side is there yet;
    `POSTED`; a waiting send's (route, micro-batch, chunk); `STARTED`), its arrival event until
    consumed and its send time until consumed.

    Attributes:
        state, arrival, sent_at: the per-message lists (the engine reads them inline).
        send, post: `_send` and `_post`, or the same in C (`_pipeline_messages.Core`, where
            it was built, which also replaces `_arrivals`).
    """

    __slots__ = ("env", "net", "rows", "size", "nv", "m", "replicas", "slot", "state",
                 "arrival", "sent_at", "_on_arrival", "lean", "bytes", "send", "post")

    def __init__(self, env: CountingEnvironment, net: FlowNetwork, rows: bytearray,
                 size_bytes: float, num_virtual: int, num_microbatches: int,
                 replicas: list[int]) -> None:
        self.env, self.net, self.rows, self.size = env, net, rows, size_bytes
        self.nv, self.m = num_virtual, num_microbatches
        self.replicas = len(replicas)
        self.slot = {d: i for i, d in enumerate(replicas)}
        n = len(replicas) * 2 * num_virtual * num_microbatches
        self.state: list = [None] * n
        self.arrival: list[LeanEvent | None] = [None] * n
        self.sent_at: list[float | None] = [None] * n
        self.lean = size_bytes > 0  # transfers with bytes: `FlowNetwork.send_message`
        self.bytes = float(size_bytes)  # a flow's size
        self._on_arrival: list = []  # every transfer's callbacks (nobody changes them)
        if Core is None:
            arrivals = self._arrivals()
            next(arrivals)  # to its first wait
            self._on_arrival.append(arrivals.send)
            self.send, self.post = self._send, self._post
        else:
            core = Core(env, self.state, self.arrival, self.sent_at, rows, size_bytes,
                        self.bytes, self.lean, net.send_message, self._on_arrival,
                        self._send_plain, POSTED, STARTED, _PP_SEND)
            self._on_arrival.append(core.arrive)
            self.send, self.post = core.send, core.post

    def local_id(self, kind: str, j: int, microbatch: int) -> int:
        """Number of the message of `kind` ("F" or "B") into virtual stage j of the first
        simulated replica."""
        return (((kind == "B") * self.nv + j) * self.m + microbatch) * self.replicas

    def base(self, d: int) -> int:
        """What replica d's messages add to their `local_id` (d simulated)."""
        return self.slot[d]

    def _send(self, k: int, route: tuple, mb: int, chunk: int) -> None:
        """The sender's op ended: start message k's transfer over `route` (the engine's
        `_pp_route`) if its receive is posted, else leave it waiting for the receive."""
        now = self.sent_at[k] = self.env._now
        if self.state[k] is None:
            self.state[k] = (route, mb, chunk)
        else:  # the receive is posted: the transfer starts
            self.state[k] = STARTED
            links, latency, ids = route
            if self.lean and links.links:
                self.net.send_message(links, self.bytes, latency, self._on_arrival,
                                      (k, now, ids, mb, chunk))
            else:
                self._send_plain(k, route, mb, chunk)

    def _post(self, k: int) -> None:
        """The receiver posts message k's receive: a waiting send starts now. A receive posted
        before (early, `overlap_p2p_comm`) is not posted again."""
        state = self.state[k]
        if state is None:
            self.state[k] = POSTED
        elif type(state) is tuple:  # the waiting send starts
            self.state[k] = STARTED
            (links, latency, ids), mb, chunk = state
            if self.lean and links.links:
                self.net.send_message(links, self.bytes, latency, self._on_arrival,
                                      (k, self.env._now, ids, mb, chunk))
            else:
                self._send_plain(k, state[0], mb, chunk)

    def _send_plain(self, k: int, route: tuple, mb: int, chunk: int) -> None:
        """Message k's transfer where no bytes cross a link (`FlowNetwork.transfer`'s timeout)."""
        links, latency, ids = route
        done = self.net.transfer(links, self.size, latency)
        done.callbacks.append(self._on_arrival[0])
        done.message = (k, self.env._now, ids, mb, chunk)

    def _arrivals(self):
        """The transfers' callback, a generator sent each transfer's event when its last byte is
        in (resuming a generator costs the event loop less than calling a method): record the
        send and fire the message's arrival event, scheduled as `succeed()` would on the
        engine's `CountingEnvironment`: the receiver's `LeanEvent` where it waits, else the
        transfer's own event (the flow of `FlowNetwork.send_message`, which succeeded and is
        free to fire again), consumed when the receiver gets there."""
        env, rows, arrival, append, size = self.env, self.rows, self.arrival, append_row, self.size
        while True:
            done = yield
            k, begun, (sender, stream), mb, chunk = done.message
            now = env._now
            append(rows, begun, now, size, sender, mb, chunk, stream, _PP_SEND)
            ev = arrival[k]
            if ev is None:  # nobody waits for it yet
                ev = arrival[k] = done
                ev.callbacks = ()  # none: the receiver sets its own when it waits
            bucket = env.now_bucket  # the bucket being processed: `now`'s NORMAL one, if that
            if bucket is None:
                bucket = env.normal.get(now)
                if bucket is None:
                    bucket = env.new_bucket(now)
            bucket.append(ev)


PIPELINE_MESSAGES_ABI = 1
"""The interface version of `_pipeline_messages.c` (its `ABI`) that `PipelineMessages` calls."""
# send, post and arrival in C (`_pipeline_messages.c`, an optional extension); None where it
# was not built or was built with another interface
Core = getattr(extension("holmes_sim.sim._pipeline_messages", PIPELINE_MESSAGES_ABI), "Core", None)
