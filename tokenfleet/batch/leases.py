"""Request leasing: how gateways claim queued requests, keep them, and give them back.

A lease claims queued requests for one owner (a gateway) until a lease deadline and bumps
each one's lease_epoch. A result is recorded only while that lease is current (status
leased, same epoch), so a holder that lost its lease cannot overwrite what came after.
Leases end by complete()/complete_many() with a result, or without one by release(),
requeue_owner() and requeue_expired_leases(): queued again, errored after too many
attempts, or canceled when the batch is canceling. On PostgreSQL the claim reads with
`FOR UPDATE SKIP LOCKED`, so gateways sharing the database never claim the same row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Text,
    and_,
    bindparam,
    case,
    exists,
    literal,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Row

from tokenfleet.batch.database import StoreBase, logger
from tokenfleet.batch.schema import (
    LeasedRequest,
    Outcome,
    RequestStatus,
    batch_requests,
    batches,
)

_FINAL_BY_COMPLETE: tuple[RequestStatus, ...] = ("succeeded", "errored", "canceled")

_b = batches.c
_r = batch_requests.c


class LeasesMixin(StoreBase):
    """The lease methods of BatchStore."""

    def lease(
        self, owner: str, max_requests: int, lease_seconds: float, now: float
    ) -> list[LeasedRequest]:
        """Claims up to `max_requests` queued requests for `owner` until now + lease_seconds.

        Earliest deadline first (batch expires_at, then created_at), and within a batch
        grouped by prefix_key, then idx, so requests sharing a prompt prefix come together.
        Each claim bumps the request's attempts and lease_epoch.
        """
        # Two statements, not UPDATE ... WHERE key IN (SELECT ... LIMIT n): PostgreSQL may
        # plan that as a nested-loop semi join that reruns the subquery for every row, and
        # so claim more than n rows.
        picked = (
            select(_r.batch_id, _r.idx)
            .where(_r.status == "queued", _r.deadline > now)
            .order_by(_r.deadline, _r.submitted_at, _r.batch_id, _r.prefix_key, _r.idx)
            .limit(max_requests)
            .with_for_update(skip_locked=True)  # PostgreSQL; SQLite compiles it away
        )
        with self.engine.begin() as conn:
            keys = [(row.batch_id, row.idx) for row in conn.execute(picked)]
            idxs_by_batch: dict[str, list[int]] = {}
            for batch_id, idx in keys:
                idxs_by_batch.setdefault(batch_id, []).append(idx)
            claimed: dict[tuple[str, int], Row[Any]] = {}
            targets: dict[str, Row[Any]] = {}
            # Per batch `idx IN (...)`: a (batch_id, idx) IN list costs PostgreSQL more to
            # plan than to run.
            for batch_id, idxs in idxs_by_batch.items():
                for row in conn.execute(
                    update(batch_requests)
                    .where(_r.batch_id == batch_id, _r.idx.in_(idxs))
                    .values(
                        status="leased",
                        lease_owner=owner,
                        lease_expires_at=now + lease_seconds,
                        lease_epoch=_r.lease_epoch + 1,
                        attempts=_r.attempts + 1,
                    )
                    .returning(_r.idx, _r.custom_id, _r.params, _r.lease_epoch, _r.attempts)
                ):
                    claimed[batch_id, row.idx] = row
                targets[batch_id] = conn.execute(
                    select(_b.endpoint, _b.api).where(_b.id == batch_id)
                ).one()
        if keys:
            logger.debug("%s leased %d requests", owner, len(keys))
        return [
            LeasedRequest(
                batch_id=batch_id,
                idx=idx,
                custom_id=claimed[batch_id, idx].custom_id,
                params=claimed[batch_id, idx].params,
                epoch=claimed[batch_id, idx].lease_epoch,
                attempts=claimed[batch_id, idx].attempts,
                endpoint=targets[batch_id].endpoint,
                api=targets[batch_id].api,
            )
            for batch_id, idx in keys  # in lease order: RETURNING keeps none
        ]

    def complete(
        self,
        batch_id: str,
        idx: int,
        epoch: int,
        status: RequestStatus,
        result_json: str | None,
        now: float,
    ) -> bool:
        """Records a leased request's outcome (succeeded, errored or canceled).

        False, and nothing written, when the lease is no longer current: the request was
        requeued, expired or completed since, e.g. a cut-off engine reporting late.
        """
        if status not in _FINAL_BY_COMPLETE:
            raise ValueError(f"complete() takes one of {_FINAL_BY_COMPLETE}, got {status!r}")
        with self.engine.begin() as conn:
            return bool(
                conn.execute(
                    update(batch_requests)
                    .where(_lease_is(batch_id, idx, epoch))
                    .values(
                        status=status,
                        result=result_json,
                        finished_at=now,
                        lease_owner=None,
                        lease_expires_at=None,
                    )
                ).rowcount
            )

    def complete_many(self, outcomes: Sequence[Outcome], now: float) -> int:
        """complete() for many requests in one transaction and one prepared statement (the
        dispatcher's group commit); returns how many were accepted."""
        if not outcomes:
            return 0
        for o in outcomes:
            if o.status not in _FINAL_BY_COMPLETE:
                raise ValueError(f"complete() takes one of {_FINAL_BY_COMPLETE}, got {o.status!r}")
        statement = (
            update(batch_requests)
            .where(
                _r.batch_id == bindparam("b_batch_id"),
                _r.idx == bindparam("b_idx"),
                _r.status == "leased",
                _r.lease_epoch == bindparam("b_epoch"),
            )
            .values(
                status=bindparam("b_status"),
                result=bindparam("b_result"),
                finished_at=now,
                lease_owner=None,
                lease_expires_at=None,
            )
        )
        rows = [
            {
                "b_batch_id": o.batch_id,
                "b_idx": o.idx,
                "b_epoch": o.epoch,
                "b_status": o.status,
                "b_result": o.result_json,
            }
            for o in outcomes
        ]
        with self.engine.begin() as conn:
            return int(conn.execute(statement, rows).rowcount)

    def release(
        self,
        batch_id: str,
        idx: int,
        epoch: int,
        now: float,
        error_json: str | None = None,
        max_attempts: int = 3,
    ) -> RequestStatus | None:
        """Gives a leased request back after an engine failure.

        It is queued again, or errored (with `error_json` as its result) once it has been
        leased `max_attempts` times, or canceled if its batch is canceling. Returns the
        new status, or None when the lease was no longer current.
        """
        with self.engine.begin() as conn:
            statuses = _end_leases(
                conn, _lease_is(batch_id, idx, epoch), now, error_json, max_attempts
            )
        return statuses[0] if statuses else None

    def requeue_owner(
        self, owner: str, now: float, error_json: str | None = None, max_attempts: int = 3
    ) -> int:
        """Ends every lease `owner` holds (a dead engine, a restarted gateway) as release()
        does; returns how many. Their late results are refused."""
        with self.engine.begin() as conn:
            num = len(_end_leases(conn, _r.lease_owner == owner, now, error_json, max_attempts))
        if num:
            logger.info("requeued %d requests leased by %s", num, owner)
        return num

    def renew_leases(self, owner: str, lease_seconds: float, now: float) -> int:
        """Extends every lease `owner` holds to now + lease_seconds; returns how many.

        A gateway calls it while its requests run, so that only a gateway that stopped
        renewing (a dead one) loses its leases to requeue_expired_leases().
        """
        with self.engine.begin() as conn:
            return conn.execute(
                update(batch_requests)
                .where(_r.status == "leased", _r.lease_owner == owner)
                .values(lease_expires_at=now + lease_seconds)
            ).rowcount

    def requeue_expired_leases(
        self, now: float, error_json: str | None = None, max_attempts: int = 3
    ) -> int:
        """Ends every lease past its lease_expires_at as release() does; returns how many.

        This is how the leases of a gateway that died without a word come back.
        """
        with self.engine.begin() as conn:
            num = len(_end_leases(conn, _r.lease_expires_at <= now, now, error_json, max_attempts))
        if num:
            logger.info("requeued %d requests whose lease expired", num)
        return num


def _lease_is(batch_id: str, idx: int, epoch: int) -> ColumnElement[bool]:
    return and_(
        _r.batch_id == batch_id, _r.idx == idx, _r.status == "leased", _r.lease_epoch == epoch
    )


def _end_leases(
    conn: Connection,
    which: ColumnElement[bool],
    now: float,
    error_json: str | None,
    max_attempts: int,
) -> list[RequestStatus]:
    """Ends the leases `which` selects without a result; returns each one's new status."""
    canceling = exists().where(_b.id == _r.batch_id, _b.state == "canceling")
    exhausted = _r.attempts >= max_attempts  # SET sees the old row: attempts of this lease
    return list(
        conn.execute(
            update(batch_requests)
            .where(_r.status == "leased", which)
            .values(
                status=case((canceling, "canceled"), (exhausted, "errored"), else_="queued"),
                result=case(
                    (
                        and_(~canceling, exhausted),
                        literal(error_json, Text()),
                    ),
                    else_=null(),
                ),
                finished_at=case((or_(canceling, exhausted), now), else_=null()),
                lease_owner=None,
                lease_expires_at=None,
            )
            .returning(_r.status)
        ).scalars()
    )
