"""Request leasing: how gateways claim queued requests, keep them, and give them back.

A lease claims queued requests for one owner (a gateway) until a lease deadline and bumps
each one's lease_epoch. A result is recorded only while that lease is current (status
leased, same epoch), so a holder that lost its lease cannot overwrite what came after.
Leases end by complete()/complete_many() with a result, or without one by release(),
requeue_owner() and requeue_expired_leases(): queued again, errored after too many
attempts, or canceled when the batch is canceling. On PostgreSQL the claim reads with
`FOR UPDATE SKIP LOCKED`, so gateways sharing the database never claim the same row.

Over 400 lines: every way a lease ends follows the one epoch rule, kept beside the claim.
"""

from __future__ import annotations

import heapq
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
    func,
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
        self,
        owner: str,
        max_requests: int,
        lease_seconds: float,
        now: float,
        store_clock: bool = False,
    ) -> list[LeasedRequest]:
        """Claims up to `max_requests` queued requests for `owner` until lease_seconds from now.

        Shared fairly across the callers (batch owners, one per API key) that have queued
        work: each gets the free room in turn, the one with the fewest requests leased
        (here and by other gateways) first, so one caller's large job cannot hold every
        slot while another's waits. Within a caller, earliest deadline first (batch
        expires_at, then created_at), and within a batch grouped by prefix_key, then idx,
        so requests sharing a prompt prefix come together. The result is in that order.
        Each claim bumps the request's attempts (leases so far) and lease_epoch.

        `store_clock`: the lease runs out lease_seconds after the database's clock rather
        than `now`, so that gateways whose clocks disagree judge expiry alike.
        """
        if max_requests <= 0:
            return []
        expires_at = (self.db_now() if store_clock else literal(now)) + lease_seconds
        with self.engine.begin() as conn:
            open_batches = conn.execute(
                select(_b.id, _b.owner, _b.expires_at, _b.created_at, _b.endpoint, _b.api)
                .where(_b.state == "in_progress", _b.expires_at > now)
                .order_by(_b.expires_at, _b.created_at, _b.id)
            ).all()
            if not open_batches:
                return []
            by_owner: dict[str, list[Row[Any]]] = {}
            for batch in open_batches:
                by_owner.setdefault(batch.owner, []).append(batch)
            held = dict.fromkeys(by_owner, 0)
            for batch_owner, num in conn.execute(
                select(_b.owner, func.count())
                .select_from(batch_requests.join(batches, _b.id == _r.batch_id))
                .where(_r.status == "leased")
                .group_by(_b.owner)
            ):
                if batch_owner in held:
                    held[batch_owner] = num
            picked = _fair_pick(conn, by_owner, held, max_requests)
            claimed: dict[tuple[str, int], Row[Any]] = {}
            targets = {batch.id: batch for batch in open_batches}
            idxs_by_batch: dict[str, list[int]] = {}
            for batch_id, idx in picked:
                idxs_by_batch.setdefault(batch_id, []).append(idx)
            # Per batch `idx IN (...)`: a (batch_id, idx) IN list costs PostgreSQL more to
            # plan than to run.
            for batch_id, idxs in idxs_by_batch.items():
                for row in conn.execute(
                    update(batch_requests)
                    .where(_r.batch_id == batch_id, _r.idx.in_(idxs))
                    .values(
                        status="leased",
                        lease_owner=owner,
                        lease_expires_at=expires_at,
                        lease_epoch=_r.lease_epoch + 1,
                        attempts=_r.attempts + 1,
                    )
                    .returning(_r.idx, _r.custom_id, _r.params, _r.lease_epoch, _r.attempts)
                ):
                    claimed[batch_id, row.idx] = row
        if picked:
            logger.debug("%s leased %d requests", owner, len(picked))
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
                owner=targets[batch_id].owner,
            )
            for batch_id, idx in picked  # in lease order: RETURNING keeps none
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
        """Gives a leased request back without a result.

        With `error_json` the lease counts as a failed attempt of the request itself (its
        engine died while running it): it is queued again, or errored with `error_json` as
        its result once it has failed `max_attempts` times. Without, it is queued again and
        nothing is counted (its gateway stopped, say). Either way canceled if its batch is
        canceling. Returns the new status, or None when the lease was no longer current.
        """
        with self.engine.begin() as conn:
            statuses = _end_leases(
                conn, _lease_is(batch_id, idx, epoch), now, error_json, max_attempts
            )
        return statuses[0] if statuses else None

    def requeue_owner(
        self, owner: str, now: float, error_json: str | None = None, max_attempts: int = 3
    ) -> int:
        """Ends every lease `owner` holds (a gateway stopping or restarted) as release()
        does; returns how many. Their late results are refused."""
        with self.engine.begin() as conn:
            num = len(_end_leases(conn, _r.lease_owner == owner, now, error_json, max_attempts))
        if num:
            logger.info("requeued %d requests leased by %s", num, owner)
        return num

    def renew_leases(
        self, owner: str, lease_seconds: float, now: float, store_clock: bool = False
    ) -> int:
        """Extends every lease `owner` holds to lease_seconds from now; returns how many.

        A gateway calls it while its requests run, so that only a gateway that stopped
        renewing (a dead one) loses its leases to requeue_expired_leases().
        `store_clock`: from the database's clock rather than `now` (see lease()).
        """
        start = self.db_now() if store_clock else literal(now)
        with self.engine.begin() as conn:
            return conn.execute(
                update(batch_requests)
                .where(_r.status == "leased", _r.lease_owner == owner)
                .values(lease_expires_at=start + lease_seconds)
            ).rowcount

    def requeue_expired_leases(
        self,
        now: float,
        error_json: str | None = None,
        max_attempts: int = 3,
        store_clock: bool = False,
    ) -> int:
        """Ends every lease past its lease_expires_at as release() does; returns how many.

        This is how the leases of a gateway that died without a word come back.
        `store_clock`: past by the database's clock rather than `now` (see lease()).
        """
        current = self.db_now() if store_clock else literal(now)
        with self.engine.begin() as conn:
            num = len(
                _end_leases(conn, _r.lease_expires_at <= current, now, error_json, max_attempts)
            )
        if num:
            logger.info("requeued %d requests whose lease expired", num)
        return num


def _fair_pick(
    conn: Connection,
    by_owner: dict[str, list[Row[Any]]],
    held: dict[str, int],
    max_requests: int,
) -> list[tuple[str, int]]:
    """Up to `max_requests` queued (batch_id, idx), shared across owners: each free slot
    goes to the owner with queued work that holds the fewest leases (ties: the earliest
    deadline), taken from its batches in deadline order; an owner with less queued than
    its share leaves the rest to the others. Returned in lease order."""
    picked: list[tuple[float, float, str, str, int]] = []
    taken_from: dict[str, int] = {}  # batch id -> how many of its rows are in `picked`
    spent: set[str] = set()  # batches with no queued row left
    counts = dict(held)
    active = set(by_owner)
    remaining = max_requests
    while remaining > 0 and active:
        turn = [(counts[o], by_owner[o][0].expires_at, o) for o in active]
        heapq.heapify(turn)
        want = dict.fromkeys(active, 0)
        for _ in range(remaining):
            num, first, owner = heapq.heappop(turn)
            want[owner] += 1
            heapq.heappush(turn, (num + 1, first, owner))
        progress = 0
        for owner, num in want.items():
            if num == 0:
                continue
            got = _take(conn, by_owner[owner], num, picked, taken_from, spent)
            counts[owner] += got
            progress += got
            if got < num:
                active.discard(owner)
        remaining -= progress
        if progress == 0:
            break
    picked.sort()
    return [(batch_id, idx) for _, _, batch_id, _, idx in picked]


def _take(
    conn: Connection,
    owner_batches: list[Row[Any]],
    num: int,
    picked: list[tuple[float, float, str, str, int]],
    taken_from: dict[str, int],
    spent: set[str],
) -> int:
    """Adds up to `num` more queued requests of these batches (in order) to `picked`;
    returns how many."""
    taken = 0
    for batch in owner_batches:
        if taken >= num:
            break
        if batch.id in spent:
            continue
        # Equality on the batch's deadline and creation time (copied to its requests):
        # one range of the lease index (status, deadline, submitted_at, batch_id,
        # prefix_key, idx), no sort. Rows picked earlier in this call are still queued
        # (this transaction updates them at the end): skip past them.
        rows = conn.execute(
            select(_r.prefix_key, _r.idx)
            .where(
                _r.status == "queued",
                _r.deadline == batch.expires_at,
                _r.submitted_at == batch.created_at,
                _r.batch_id == batch.id,
            )
            .order_by(_r.prefix_key, _r.idx)
            .offset(taken_from.get(batch.id, 0))
            .limit(num - taken)
            .with_for_update(skip_locked=True)  # PostgreSQL; SQLite compiles it away
        ).all()
        for row in rows:
            picked.append((batch.expires_at, batch.created_at, batch.id, row.prefix_key, row.idx))
        taken += len(rows)
        taken_from[batch.id] = taken_from.get(batch.id, 0) + len(rows)
        if len(rows) < num - (taken - len(rows)):
            spent.add(batch.id)
    return taken


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
    """Ends the leases `which` selects without a result; returns each one's new status.

    With `error_json` each counts as a failed attempt (failures + 1) and ends errored with
    it once the request has failed `max_attempts` times; without, nothing is counted and
    nothing ends errored, so no request can end errored with no error to show."""
    canceling = exists().where(_b.id == _r.batch_id, _b.state == "canceling")
    counted = error_json is not None
    # SET sees the old row: failures before this one.
    exhausted = (_r.failures + 1 >= max_attempts) if counted else literal(False)
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
                failures=_r.failures + 1 if counted else _r.failures,
            )
            .returning(_r.status)
        ).scalars()
    )
