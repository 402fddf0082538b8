"""kombu's Redis transport with worker leases (llmpipe/broker/leases.py): celeryconfig selects it
for a redis:// broker (``broker_transport``), and its Sentinel twin (``SentinelTransport``)
for a sentinel:// one.

What changes against kombu's transport, and why:

* Consuming. kombu BRPOPs a message and records it as unacked in a second call; a worker
  killed in between loses it. Here a message leaves its queue only inside the claim script,
  which records it as held in the same step. While its queues are empty a consumer blocks
  on wake lists instead (``llmpipe:wake:{queue}``: producers push one token per message,
  so one waiting consumer wakes per message, as with BRPOP) and then claims. A message
  pushed by a producer that does not push tokens (plain kombu) is still claimed, at the
  end of the next wait (``brpop_timeout``, 1 s). The claim goes out with the wait, pipelined
  behind the BRPOP: Redis runs it as soon as a token unblocks the wait, so a woken consumer
  reads its message in the same round trip and event-loop turn as its token. Only while
  batch-lane claims are held back (below) is the claim sent after the wake, with the gate as
  it is then.
* Acks and rejects count only while this channel's lease still holds the message.
* The visibility timeout (kombu's ``restore_visible``) never restores a message whose holder
  lease is alive; it stays for messages held by no lease.
* Every consuming channel keeps a lease renewed by a thread, and sweeps expired leases:
  any live consumer returns a dead worker's messages, with or without a supervisor.
* Lanes. For ``lane_slot_hold_s`` after a consumer took an interactive message, it holds
  batch-lane messages in at most ``lane_batch_slot_share`` of its prefetch and claims only
  from the interactive lists beyond that (llmpipe/jobs/lanes.py ``BatchClaims``); settling
  one of them wakes it to claim the next.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from queue import Empty
from time import monotonic

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads
from kombu.utils.objects import cached_property

from llmpipe.broker.leases import LeaseKeeper, LeaseStore, new_lease_id, parse_claim, wake_key
from llmpipe.broker.redis_qos import QoS
from llmpipe.broker.worker_queues import Drainer
from llmpipe.jobs.lanes import BatchClaims, Lane, broker_priority, lane_of_message
from llmpipe.stages import is_worker_queue, shared_queue

log = logging.getLogger("llmpipe.broker.leases")


class Channel(kombu_redis.Channel):
    QoS = QoS

    #: A lease not renewed for this long is dead and its messages go back (settings.lease_ttl_s).
    lease_ttl = 4.0
    #: How often each consumer renews its lease and sweeps dead ones (settings.lease_sweep_interval_s).
    lease_sweep_interval = 1.0

    #: While interactive messages come, batch-lane ones are held in at most this share of the
    #: prefetch, for this long after the last interactive one (llmpipe/jobs/lanes.py BatchClaims).
    lane_batch_slot_share = 1.0
    lane_slot_hold_s = 0.0
    #: Between interactive messages, the share of the prefetch batch-lane ones never take.
    lane_interactive_reserve = 0.0

    from_transport_options = kombu_redis.Channel.from_transport_options + (
        "lease_ttl", "lease_sweep_interval", "lane_batch_slot_share", "lane_slot_hold_s", "lane_interactive_reserve")

    def __init__(self, *args, **kwargs):
        self._tag_lease: dict[str, str] = {}
        self._lease_id: str | None = None
        self._keeper: LeaseKeeper | None = None
        self._lease_lock = threading.Lock()
        self._lease_pid = os.getpid()
        self._leases_closed = False
        self._waiting = False  # the last claim found the queues empty: wait for a token
        self._woken: str | None = None  # the queue whose token woke us: claim from it first
        self._sent: tuple[str, str | None] | None = None
        self._no_ack_queues: set[str] = set()  # consumed without acks: never held
        self._sync_client: tuple = (None, None)  # (pool, client): see conn_or_acquire
        super().__init__(*args, **kwargs)
        self._batch_claims = BatchClaims(self.lane_batch_slot_share, self.lane_slot_hold_s,
                                         reserve=self.lane_interactive_reserve)
        self._batch_gated = False  # the last claim left the batch lists out (BatchClaims)
        if self.global_keyprefix:
            raise ValueError("llmpipe's Redis transport does not support global_keyprefix")

    @contextmanager
    def conn_or_acquire(self, client=None):
        # kombu builds a new redis.Redis (its ~170 response callbacks) for every publish,
        # ack and event: about 0.05 ms each, a dozen per request. One client per pool
        # serves them all (redis-py clients are thread-safe); a new pool (after a fork or
        # a reconnect) gets a new one.
        if client:
            yield client
            return
        pool, cached = self._sync_client
        if cached is None or pool is not self.pool:
            pool, cached = self._sync_client = (self.pool, self._create_client())
        yield cached

    # -- leases ---------------------------------------------------------------------------
    @cached_property
    def _lease_store(self) -> LeaseStore:
        # A client of its own (the keeper thread and acks from task threads use it).
        r = self.Client(connection_pool=self._lease_pool())
        return LeaseStore(r, unacked_key=self.unacked_key, unacked_index_key=self.unacked_index_key, sep=self.sep)

    def _lease_pool(self):
        return kombu_redis.redis.ConnectionPool(**self._connparams())

    @cached_property
    def _drainer(self) -> Drainer:
        return Drainer(self._lease_store.r)

    def _ensure_lease(self) -> str | None:
        if self._leases_closed or os.getpid() != self._lease_pid:
            return None
        with self._lease_lock:
            if self._lease_id is None:
                store = self._lease_store
                store.load_scripts()
                lease_id = new_lease_id()
                store.create(lease_id, self.lease_ttl)
                # the worker queues it consumes are its own until this lease dies (llmpipe/broker/worker_queues.py)
                self._drainer.own([q for q in self._active_queues if is_worker_queue(q)], lease_id)
                if self._keeper is None:
                    self._keeper = LeaseKeeper(store, self.lease_ttl, min(self.lease_sweep_interval, self.lease_ttl / 3),
                                               on_lost=self._on_lease_lost, drain=self._drainer.drain).start()
                self._keeper.hold(lease_id)
                self._lease_id = lease_id
                log.info("lease %s taken (ttl %.1fs)", lease_id, self.lease_ttl)
            return self._lease_id

    def _on_lease_lost(self, lease_id: str) -> None:
        with self._lease_lock:
            if self._lease_id == lease_id:
                self._lease_id = None
        log.warning("lease %s was lost: this worker was silent longer than %.1fs and its messages went to other "
                    "workers; a new lease is taken, and the late results are the first ones (idempotent stages)",
                    lease_id, self.lease_ttl)

    def release_lease(self) -> int:
        """Stop claiming and give back, at once, everything the lease holds (claimed, running
        or with a reply still unread); returns how many went back."""
        with self._lease_lock:
            self._leases_closed = True
            lease_id, self._lease_id = self._lease_id, None
        if self._keeper is not None:
            self._keeper.stop()
        if lease_id is None or os.getpid() != self._lease_pid:
            return 0
        self._keeper.drop(lease_id)
        n = self._lease_store.release(lease_id)
        for tag in [t for t, lid in list(self._tag_lease.items()) if lid == lease_id]:
            self._tag_lease.pop(tag, None)
        return n

    # -- consuming ------------------------------------------------------------------------
    def basic_consume(self, queue, no_ack, *args, **kwargs):
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        out = super().basic_consume(queue, no_ack, *args, **kwargs)
        lease_id = self._lease_id
        if lease_id is not None and is_worker_queue(queue):
            self._drainer.own([queue], lease_id)
        return out

    def _brpop_start(self, timeout=None):
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        lease_id = self._ensure_lease()
        wait = ["BRPOP", *[wake_key(q) for q in queues], timeout or 0]
        if lease_id is None:
            self._waiting = True
            commands, self._sent = [wait], ("wait", None)
        elif not self._waiting:
            commands, self._sent = [self._claim_command(lease_id, queues)], ("claim", lease_id)
        else:
            claim = self._claim_command(lease_id, queues)  # reads the batch-lane gate afresh
            if self._batch_gated:  # the gate may open during the wait: claim after it
                commands, self._sent = [wait], ("wait", None)
            else:  # it cannot close during the wait (only a claim of ours closes it)
                commands, self._sent = [wait, claim], ("wait+claim", lease_id)
        self._in_poll = conn = self.client.connection
        self._brpop_sent_at = monotonic()
        conn.send_packed_command(conn.pack_commands(commands))

    def _claim_command(self, lease_id: str, queues: list[str]) -> list:
        """The claim over ``queues``' claimable priority lists, highest priority first; after
        a wake on its own, the woken queue's lists before the others'."""
        if self._woken in queues:
            queues = [self._woken] + [q for q in queues if q != self._woken]
        keys = [(self._q_for_pri(q, pri), q, q not in self._no_ack_queues) for pri in self._claimable_steps()
                for q in queues]
        if self._woken is not None:  # the woken queue's own keys first
            keys.sort(key=lambda kq: kq[1] != self._woken)
        return self._lease_store.claim_command(lease_id, keys)

    def _brpop_read(self, **options):
        sent, self._sent = self._sent, None
        try:
            kind, lease_id = sent or ("wait", None)
            if kind != "claim":
                try:
                    woken = self._read_reply("BRPOP", **options)
                except self.ResponseError:
                    if kind == "wait+claim":  # the claim's reply is still unread: drop the connection
                        self.client.connection.disconnect()
                    raise
                self._waiting = False  # a token, or the wait timed out: claim next
                self._woken = bytes_to_str(woken[0]).removeprefix(wake_key("")) if woken and kind == "wait" else None
                if kind == "wait":
                    raise Empty()
            claim = parse_claim(self._read_reply("EVALSHA", **options))
            self._woken = None
            if claim.status in ("ok", "raw"):
                self._waiting = not claim.more
                dest = claim.key.rsplit(self.sep, 1)[0]
                self._queue_cycle.rotate(dest)
                message = loads(bytes_to_str(claim.payload))
                if lane_of_message(message.get("properties")) is Lane.INTERACTIVE:
                    self._batch_claims.interactive_taken()
                if claim.status == "ok":
                    self._tag_lease[message["properties"]["delivery_tag"]] = lease_id
                self.connection._deliver(message, dest)
                return True
            if claim.status == "empty":
                self._waiting = True
            elif claim.status == "expired":
                self._renew_now(lease_id)
            else:  # lost
                self._on_lease_lost(lease_id)
            raise Empty()
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _read_reply(self, command: str, **options):
        try:
            return self.client.parse_response(self.client.connection, command, **options)
        except self.connection_errors:
            self.client.connection.disconnect()
            raise
        except self.ResponseError as exc:
            if "NOSCRIPT" in str(exc):  # Redis restarted: load the scripts, claim again
                self._lease_store.load_scripts()
                self._waiting = False
                raise Empty() from None
            raise

    def _claimable_steps(self) -> list[int]:
        """The priority lists to claim from: the batch lane's too, unless the consumer holds
        its share of batch-lane messages while interactive ones come (BatchClaims). Remembers
        which, for batch_settled."""
        qos = self.qos
        held = sum(1 for tag, m in list(qos._delivered.items())  # kombu's unacked: tag -> Message
                   if tag not in qos._dirty and lane_of_message(m.properties) is Lane.BATCH)
        if self._batch_claims.open(held, self.qos.prefetch_count or 0):
            self._batch_gated = False
            return self.priority_steps
        self._batch_gated = True
        return [p for p in self.priority_steps if p < broker_priority(Lane.BATCH)]

    def batch_settled(self) -> None:
        """A batch-lane message this channel held was acked or rejected (QoS). If batch claims
        were held back, wake this consumer (one token per queue), which otherwise waits on
        its token lists until the next message or the wait's end and, under a steady stream of
        interactive messages, would claim only those."""
        if not self._batch_gated:
            return
        self._batch_gated = False
        queues = list(self.active_queues)
        if queues:
            with self.conn_or_acquire() as client:
                with client.pipeline(transaction=False) as pipe:
                    for q in queues:
                        pipe.lpush(wake_key(q), "1")
                    pipe.execute()

    def _renew_now(self, lease_id: str) -> None:
        for lost in self._lease_store.renew([lease_id], self.lease_ttl):
            if self._keeper is not None:
                self._keeper.drop(lost)
            self._on_lease_lost(lost)

    # -- producing and restoring: one wake token per message -------------------------------
    def _put(self, queue, message, **kwargs):
        pri = self._get_message_priority(message, reverse=False)
        key = self._q_for_pri(queue, pri)
        publish_batch = kwargs.pop("_publish_batch", None)
        if publish_batch is not None:
            publish_batch.add("lpush", key, dumps(message))
            publish_batch.add("lpush", wake_key(queue), "1")
            if self._expires and queue in self._expires:
                for p in self.priority_steps:
                    publish_batch.add("pexpire", self._q_for_pri(queue, p), self._expires[queue])
                publish_batch.add("pexpire", wake_key(queue), self._expires[queue])
            return
        with self.conn_or_acquire() as client:
            with client.pipeline(transaction=False) as pipe:
                pipe.lpush(key, dumps(message))
                pipe.lpush(wake_key(queue), "1")
                if self._expires and queue in self._expires:  # a queue that expires (a reply queue): its tokens too
                    for p in self.priority_steps:
                        pipe.pexpire(self._q_for_pri(queue, p), self._expires[queue])
                    pipe.pexpire(wake_key(queue), self._expires[queue])
                pipe.execute()

    def _do_restore_message(self, payload, exchange, routing_key, pipe, leftmost=False):
        """kombu's restore, with a wake token per message, and a message of a single
        worker's own queue restored to its shared queue: the worker that gives it back
        cannot serve it (llmpipe/broker/worker_queues.py)."""
        try:
            try:
                payload["headers"]["redelivered"] = True
                payload["properties"]["delivery_info"]["redelivered"] = True
            except KeyError:
                pass
            pri = self._get_message_priority(payload, reverse=False)
            for queue in dict.fromkeys(shared_queue(q) for q in self._lookup(exchange, routing_key)):
                (pipe.lpush if leftmost else pipe.rpush)(self._q_for_pri(queue, pri), dumps(payload))
                pipe.lpush(wake_key(queue), "1")
        except self.connection_errors:
            # Abort the transaction: it would otherwise remove the message from the unacked
            # hash without requeueing it.
            raise
        except Exception:
            log.critical("could not restore message: %r", payload, exc_info=True)

    def _restore(self, message, leftmost=False):
        tag = message.delivery_tag
        if tag in self._tag_lease:
            return self.qos.restore_by_tag(tag, leftmost=leftmost)
        return super()._restore(message, leftmost)

    def close(self):
        try:
            super().close()
        finally:
            if not self._leases_closed:
                try:
                    n = self.release_lease()
                    if n:
                        log.info("released %d message(s) at close", n)
                except Exception:  # Redis away: the lease expires and another worker sweeps it
                    log.debug("could not release the lease at close", exc_info=True)


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The leased channel over Redis Sentinel (``sentinel://`` broker URLs, with
    ``master_name`` in the transport options): kombu's SentinelChannel finds the master for
    the consuming and producing connections, and the lease client asks the sentinels too, so
    after a failover claims, acks, renewals and sweeps all go to the promoted replica."""

    from_transport_options = tuple(dict.fromkeys(Channel.from_transport_options
                                                 + kombu_redis.SentinelChannel.from_transport_options))
    _lease_sentinel = None

    def _lease_pool(self):
        # kombu's _sentinel_managed_pool keeps the Sentinel it makes, to close it with the
        # channel's pools; the channel's own one must stay the one kept.
        kept = self._sentinel_manager
        try:
            return self._sentinel_managed_pool()
        finally:
            self._lease_sentinel, self._sentinel_manager = self._sentinel_manager, kept

    def close(self):
        try:
            super().close()
        finally:
            if self._lease_sentinel is not None:
                try:
                    self._lease_sentinel.close()
                except Exception:
                    log.debug("could not close the lease client's sentinel connections", exc_info=True)


class SentinelTransport(Transport):
    Channel = SentinelChannel
    default_port = kombu_redis.SentinelTransport.default_port


def transport_for(broker_url: str) -> str | None:
    """The leased transport for a Redis broker URL (redis://, rediss://, sentinel://), as
    celeryconfig names it; None for any other broker (RabbitMQ)."""
    scheme = broker_url.split("://", 1)[0].lower()
    return {"redis": f"{__name__}:Transport", "rediss": f"{__name__}:Transport",
            "sentinel": f"{__name__}:SentinelTransport"}.get(scheme)
