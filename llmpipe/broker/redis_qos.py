"""kombu's ack emulation made lease-aware (the QoS of llmpipe/broker/redis_transport.py's
Channel): acks and rejects count only while the channel's lease still holds the message, and
the visibility timeout never restores a message whose holder lease is alive."""

from __future__ import annotations

import logging

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from llmpipe.broker.leases import HOLDER_KEY, LEASES_KEY, lease_tags_key
from llmpipe.jobs.lanes import Lane, lane_of_message

log = logging.getLogger("llmpipe.broker.leases")


class QoS(kombu_redis.QoS):
    """kombu's ack emulation, made lease-aware for the messages this channel claimed."""

    def append(self, message, delivery_tag):
        if delivery_tag in self.channel._tag_lease:
            # the claim script already recorded it in Redis
            kombu_redis.virtual.QoS.append(self, message, delivery_tag)
        else:
            super().append(message, delivery_tag)

    def ack(self, delivery_tag):
        lease_id = self.channel._tag_lease.pop(delivery_tag, None)
        if lease_id is None:
            return super().ack(delivery_tag)
        if not self.channel._lease_store.ack(delivery_tag, lease_id):
            log.warning("late ack of %s ignored: lease %s no longer holds it (another worker has it now)",
                        delivery_tag, lease_id)
        message = self._delivered.get(delivery_tag)
        kombu_redis.virtual.QoS.ack(self, delivery_tag)
        if message is not None and lane_of_message(message.properties) is Lane.BATCH:
            self.channel.batch_settled()

    def reject(self, delivery_tag, requeue=False):
        if delivery_tag not in self.channel._tag_lease:
            return super().reject(delivery_tag, requeue=requeue)
        if requeue:
            self.restore_by_tag(delivery_tag, leftmost=True)
            kombu_redis.virtual.QoS.ack(self, delivery_tag)
        else:
            self.ack(delivery_tag)

    def restore_by_tag(self, tag, client=None, leftmost=False):
        """kombu's restore (the message goes back marked redelivered), but only while this
        channel's lease holds it; a message claimed elsewhere is restored only if no live
        lease holds it."""
        tag = bytes_to_str(tag)
        owner = self.channel._tag_lease.pop(tag, None)
        self._restore_guarded(tag, client, leftmost, owner=owner)

    def _restore_guarded(self, tag, client=None, leftmost=False, owner=None) -> bool:
        done = []

        def restore_transaction(pipe):
            done.clear()
            holder = pipe.hget(HOLDER_KEY, tag)
            holder = bytes_to_str(holder) if holder is not None else None
            if owner is not None and holder != owner:
                return  # swept: another worker may run it now
            if owner is None and holder is not None and pipe.zscore(LEASES_KEY, holder) is not None:
                return  # held by a live lease: never redelivered
            p = pipe.hget(self.unacked_key, tag)
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            if holder is not None:
                pipe.hdel(HOLDER_KEY, tag)
                pipe.hdel(lease_tags_key(holder), tag)
            if p:
                M, EX, RK = loads(bytes_to_str(p))
                self.channel._do_restore_message(M, EX, RK, pipe, leftmost)
                done.append(tag)

        with self.channel.conn_or_acquire(client) as client:
            client.transaction(restore_transaction, self.unacked_key, HOLDER_KEY)
        return bool(done)

    def restore_visible(self, start=0, num=10, interval=10):
        """The last resort: kombu's visibility timeout, skipping messages of live leases."""
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        with self.channel.conn_or_acquire() as client:
            ceil = kombu_redis.time() - self.visibility_timeout
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    visible = client.zrange(self.unacked_index_key, ceil, 0, desc=True, byscore=True,
                                            offset=num and start, num=num, withscores=True)
                    for tag, _score in visible or []:
                        tag = bytes_to_str(tag)
                        if tag in self.channel._tag_lease:
                            continue  # this process holds it and is alive
                        if self._restore_guarded(tag, client):
                            log.warning("message %s restored by the visibility timeout (held by no live lease)", tag)
            except kombu_redis.MutexHeld:
                pass
