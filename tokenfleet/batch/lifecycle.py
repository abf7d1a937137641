"""The passes the dispatcher runs over batches as time goes by: expire, end, archive.

expire_batches() turns the open requests of batches past their expires_at into expired;
finish_batches() ends batches with no queued or leased request left; archive_batches()
drops the request rows of batches ended long ago, keeping their final counts.
has_open_batches() tells the dispatcher whether any of this has work to do.
"""

from __future__ import annotations

import json

from sqlalchemy import delete, exists, select, update

from tokenfleet.batch.batches import status_counts
from tokenfleet.batch.database import StoreBase, logger
from tokenfleet.batch.schema import REQUEST_STATUSES, RequestStatus, batch_requests, batches

ARCHIVE_AFTER_SECONDS = 29 * 24 * 3600
_ACTIVE: tuple[RequestStatus, ...] = ("queued", "leased")

_b = batches.c
_r = batch_requests.c


class LifecycleMixin(StoreBase):
    """The batch lifecycle passes of BatchStore."""

    def has_open_batches(self) -> bool:
        """Whether any batch is in progress or being canceled. Only those have queued or
        leased requests, so with none the dispatcher has nothing to lease, expire, end or
        requeue: one read instead of its round of writes."""
        open_batch = exists().where(_b.state.in_(("in_progress", "canceling")))
        with self._reader.begin() as conn:
            return bool(conn.execute(select(open_batch)).scalar())

    def expire_batches(self, now: float) -> list[str]:
        """Queued and leased requests of batches past expires_at become expired.

        Returns the ids of the batches that had any; finish_batches() then ends them.
        """
        touched = []
        with self.engine.begin() as conn:
            due = conn.execute(
                select(_b.id)
                .where(_b.state.in_(("in_progress", "canceling")), _b.expires_at <= now)
                .order_by(_b.expires_at, _b.id)
            ).scalars()
            for batch_id in due.all():
                num_expired = conn.execute(
                    update(batch_requests)
                    .where(_r.batch_id == batch_id, _r.status.in_(_ACTIVE))
                    .values(
                        status="expired",
                        finished_at=now,
                        lease_owner=None,
                        lease_expires_at=None,
                    )
                ).rowcount
                if num_expired:
                    touched.append(batch_id)
                    logger.info("batch %s expired %d requests", batch_id, num_expired)
        return touched

    def finish_batches(self, now: float) -> list[str]:
        """Batches with no queued or leased request left become ended; returns their ids.

        ended_reason: canceled if a cancel was asked for, else expired if any request
        expired, else completed.
        """
        active = exists().where(_r.batch_id == _b.id, _r.status.in_(_ACTIVE))
        expired = exists().where(_r.batch_id == _b.id, _r.status == "expired")
        ended = []
        with self.engine.begin() as conn:
            candidates = conn.execute(
                select(_b.id, _b.state, expired)
                .where(_b.state.in_(("in_progress", "canceling")), ~active)
                .order_by(_b.created_at, _b.id)
            ).all()
            for batch_id, state, has_expired in candidates:
                if state == "canceling":
                    reason = "canceled"
                else:
                    reason = "expired" if has_expired else "completed"
                # The state guard makes one of two racing gateways the one that ends it.
                if conn.execute(
                    update(batches)
                    .where(_b.id == batch_id, _b.state == state)
                    .values(state="ended", ended_at=now, ended_reason=reason)
                ).rowcount:
                    ended.append(batch_id)
                    logger.info("batch %s ended: %s", batch_id, reason)
        return ended

    def archive_batches(
        self, now: float, retention_seconds: float = ARCHIVE_AFTER_SECONDS
    ) -> list[str]:
        """Ended batches created more than `retention_seconds` ago lose their request rows.

        The batch row stays (with archived_at set and its final counts); results are no
        longer downloadable. Returns the ids archived.
        """
        archived = []
        with self.engine.begin() as conn:
            due = conn.execute(
                select(_b.id).where(
                    _b.state == "ended",
                    _b.archived_at.is_(None),
                    _b.created_at <= now - retention_seconds,
                )
            ).scalars()
            for batch_id in due.all():
                counts = dict.fromkeys(REQUEST_STATUSES, 0) | status_counts(conn, batch_id)
                if conn.execute(
                    update(batches)
                    .where(_b.id == batch_id, _b.archived_at.is_(None))
                    .values(archived_at=now, archived_counts=json.dumps(counts))
                ).rowcount:
                    conn.execute(delete(batch_requests).where(_r.batch_id == batch_id))
                    archived.append(batch_id)
        if archived:
            logger.info("archived %d batches", len(archived))
        return archived
