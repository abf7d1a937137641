"""Each key group's interactive rate limits, kept in the batch store so that the gateways
sharing it see one allowance per group (the gateway's side: server/shared_limits.py).

    rate_buckets (key_group, kind)     a token bucket, `requests` or `tokens` a minute,
                                       refilled continuously, a minute's worth at most
    rate_slots   (key_group, gateway)  the group's requests running on one gateway, counted
                                       while its lease (expires_at) is ahead of the clock

A take refills a group's buckets and takes from them in one UPDATE ... RETURNING. An enter
is one short transaction:

    UPDATE rate_buckets ... RETURNING   take a request; locks the group's `requests` row,
                                        so the enters of a group, on every gateway, go one
                                        at a time
    SELECT sum(running) FROM rate_slots the group's live slots, in a statement of its own:
                                        on PostgreSQL it then reads what the enter before
                                        it committed (one statement would read its snapshot)
    UPDATE rate_slots (or INSERT)       this gateway's slot counts one more, and its lease
                                        runs lease_s from now
    (or ROLLBACK: refused, nothing taken)

A gateway renews its slots' leases while it runs; a dead one's stop counting once their
lease has run out, and are deleted a day later.

Times are Unix seconds: the store's clock (`store_clock`), read once a statement, so that
gateways whose clocks disagree agree on refills and on expiry, as batch leases do; or the
caller's `now` (the tests' clock).

These run on every interactive request: each statement is built once, with bound
parameters, and kept short enough for psycopg to cache (and PostgreSQL to prepare).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Double,
    Executable,
    Integer,
    Table,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal_column,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from tokenfleet.batch.database import StoreBase
from tokenfleet.batch.schema import rate_buckets, rate_slots

_k = rate_buckets.c
_s = rate_slots.c

STALE_S = 24 * 3600.0  # slot rows this long past their lease are deleted: their gateway is gone


@dataclass(frozen=True, slots=True)
class Take:
    """`amount` from a group's `kind` bucket of `per_minute` a minute; 0 takes nothing (the
    bucket is refilled and read)."""

    kind: str
    amount: float
    per_minute: int


@dataclass(frozen=True, slots=True)
class Level:
    """A bucket as a take left it: its level, refilled to the take's time, and whether the
    take was granted (else nothing was taken)."""

    level: float
    granted: bool


@dataclass(frozen=True, slots=True)
class Entered:
    """An enter: the buckets as it left them, the group's requests running on every gateway
    before it, and whether it was admitted (taken, and counted on the gateway's slot)."""

    levels: dict[str, Level]
    num_running: int
    admitted: bool


class LimitsStore:
    """The rate-limit tables of one batch store, on its engine. Thread-safe, as the store."""

    def __init__(self, store: StoreBase) -> None:
        self.store = store
        self._built: dict[tuple[Any, ...], Executable] = {}

    def take(
        self, group: str, takes: Sequence[Take], now: float, store_clock: bool = False
    ) -> dict[str, Level]:
        """Refill `group`'s buckets and take each amount that is there (one UPDATE)."""
        with self.store.engine.begin() as conn:
            return self._take(conn, group, takes, now, store_clock)

    def enter(
        self,
        group: str,
        gateway: str,
        takes: Sequence[Take],
        max_running: int,
        lease_s: float,
        now: float,
        store_clock: bool = False,
    ) -> Entered:
        """A request of `group` starts on `gateway`: admitted if every take is granted and
        fewer than `max_running` of the group's requests run on live slots; then counted on
        the gateway's slot. Refused, nothing is taken."""
        at = {} if store_clock else {"now": now}
        with self.store.engine.connect() as conn, conn.begin() as transaction:
            levels = self._take(conn, group, takes, now, store_clock)
            running = self._statement("running", store_clock, build=self._build_running)
            num_running = int(conn.execute(running, {"group": group, **at}).scalar_one())
            admitted = num_running < max_running and all(x.granted for x in levels.values())
            if admitted:
                # No other enter of the group can insert the slot meanwhile: this one holds
                # the group's lock. (INSERT ... ON CONFLICT is compiled anew every time.)
                params = {"group": group, "gateway_id": gateway, "lease_s": lease_s, **at}
                count_in = self._statement("count_in", store_clock, build=self._build_count_in)
                if not conn.execute(count_in, params).rowcount:
                    slot = insert(rate_slots).values(
                        key_group=group,
                        gateway=gateway,
                        running=1,
                        expires_at=self._clock(store_clock) + lease_s,
                    )
                    conn.execute(slot, at)
            else:
                transaction.rollback()
                amounts = {t.kind: t.amount for t in takes}
                levels = {
                    kind: Level(x.level + amounts[kind] if x.granted else x.level, False)
                    for kind, x in levels.items()
                }
        return Entered(levels, num_running, admitted)

    def leave(self, group: str, gateway: str, count: int = 1) -> None:
        """`count` requests of `group` on `gateway` have ended."""
        leave = self._statement("leave", build=self._build_leave)
        with self.store.engine.begin() as conn:
            conn.execute(leave, {"group": group, "gateway_id": gateway, "count": count})

    def renew(
        self,
        gateway: str,
        lease_s: float,
        now: float,
        store_clock: bool = False,
        leaves: Mapping[str, int] | None = None,
    ) -> int:
        """Extend `gateway`'s slot leases to lease_s from now, after counting down `leaves`
        (group -> requests ended that were not counted yet); deletes slots long dead.
        Returns how many slots were renewed."""
        at = self._clock(store_clock)
        params = {} if store_clock else {"now": now}
        leave = self._statement("leave", build=self._build_leave)
        with self.store.engine.begin() as conn:
            for group, count in (leaves or {}).items():
                conn.execute(leave, {"group": group, "gateway_id": gateway, "count": count})
            conn.execute(delete(rate_slots).where(_s.expires_at < at - STALE_S), params)
            renewed = conn.execute(
                update(rate_slots).where(_s.gateway == gateway).values(expires_at=at + lease_s),
                params,
            )
            return int(renewed.rowcount)

    def clear(self, gateway: str) -> None:
        """Forget `gateway`'s slots: it starts with none running, or has stopped."""
        with self.store.engine.begin() as conn:
            conn.execute(delete(rate_slots).where(_s.gateway == gateway))

    def num_running(self, group: str, now: float, store_clock: bool = False) -> int:
        """The group's requests running on live slots, every gateway's."""
        running = self._statement("running", store_clock, build=self._build_running)
        with self.store.engine.connect() as conn:
            found = conn.execute(running, {"group": group} | ({} if store_clock else {"now": now}))
            return int(found.scalar_one())

    # -- statements, built once each --------------------------------------------------------

    def _statement(self, *key: Any, build: Callable[..., Executable]) -> Executable:
        found = self._built.get(key)
        if found is None:
            found = self._built[key] = build(*key[1:])
        return found

    def _take(
        self, conn: Connection, group: str, takes: Sequence[Take], now: float, store_clock: bool
    ) -> dict[str, Level]:
        kinds = tuple(t.kind for t in takes)
        params: dict[str, Any] = {"group": group} | ({} if store_clock else {"now": now})
        for t in takes:
            params[f"per_minute_{t.kind}"] = float(t.per_minute)
            params[f"amount_{t.kind}"] = float(t.amount)
        buckets = self._statement("buckets", kinds, store_clock, build=self._build_buckets)
        found = _levels(conn.execute(buckets, params))
        missing = [t for t in takes if t.kind not in found]
        if missing:
            # The group's first take: its buckets start full (another gateway's may have
            # just started them: then that one's stand).
            for t in missing:
                full = {"key_group": group, "kind": t.kind, "level": float(t.per_minute)}
                conn.execute(
                    self._insert(rate_buckets)
                    .values({**full, "at": self._clock(store_clock), "granted": 0})
                    .on_conflict_do_nothing(index_elements=[_k.key_group, _k.kind]),
                    params,
                )
            found = _levels(conn.execute(buckets, params))
        return found

    def _build_buckets(self, kinds: tuple[str, ...], store_clock: bool) -> Executable:
        at = self._clock(store_clock)
        per_minute = _by_kind(kinds, "per_minute")
        amount = _by_kind(kinds, "amount")
        elapsed = self._greatest(at - _k.at, 0.0)
        # In RateLimiter's order of operations: the same refill to the last bit.
        refilled = self._least(per_minute, _k.level + elapsed * (per_minute / 60.0))
        granted = refilled >= amount
        return (
            update(rate_buckets)
            .where(_k.key_group == bindparam("group"), _k.kind.in_(kinds))
            .values(
                level=refilled - case((granted, amount), else_=0.0),
                at=self._greatest(_k.at, at),  # a clock that went back refills nothing
                granted=case((granted, 1), else_=0),
            )
            .returning(_k.kind, _k.level, _k.granted)
        )

    def _build_running(self, store_clock: bool) -> Executable:
        return select(func.coalesce(func.sum(_s.running), 0)).where(
            _s.key_group == bindparam("group"), _s.expires_at > self._clock(store_clock)
        )

    def _build_count_in(self, store_clock: bool) -> Executable:
        return (
            update(rate_slots)
            .where(_s.key_group == bindparam("group"), _s.gateway == bindparam("gateway_id"))
            .values(
                running=_s.running + 1,
                expires_at=self._clock(store_clock) + bindparam("lease_s", type_=Double()),
            )
        )

    def _build_leave(self) -> Executable:
        return (
            update(rate_slots)
            .where(_s.key_group == bindparam("group"), _s.gateway == bindparam("gateway_id"))
            .values(running=self._greatest(_s.running - bindparam("count", type_=Integer()), 0))
        )

    # -- the dialects -------------------------------------------------------------------------

    def _clock(self, store_clock: bool) -> ColumnElement[float]:
        if not store_clock:
            return bindparam("now", type_=Double())
        if self.store.is_sqlite:
            # 'now' is one reading for the whole statement.
            return self.store.db_now()
        # statement_timestamp(), not db_now()'s clock_timestamp(): one reading a statement,
        # however often the statement uses it.
        return literal_column(
            "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)", Double()
        )

    def _insert(self, table: Table) -> Any:
        """INSERT with ON CONFLICT, in the store's dialect."""
        return (sqlite.insert if self.store.is_sqlite else postgresql.insert)(table)

    def _least(self, a: ColumnElement[Any], b: Any) -> ColumnElement[Any]:
        # SQLite's scalar min() of two is PostgreSQL's least() (its min() an aggregate).
        return func.min(a, b) if self.store.is_sqlite else func.least(a, b)

    def _greatest(self, a: ColumnElement[Any], b: Any) -> ColumnElement[Any]:
        return func.max(a, b) if self.store.is_sqlite else func.greatest(a, b)


def _by_kind(kinds: tuple[str, ...], name: str) -> ColumnElement[float]:
    """Parameter `name`_KIND of each row's kind, as SQL."""
    values: list[ColumnElement[float]] = [
        bindparam(f"{name}_{kind}", type_=Double()) for kind in kinds
    ]
    if len(values) == 1:
        return values[0]
    return case(*((_k.kind == kind, value) for kind, value in zip(kinds, values, strict=True)))


def _levels(rows: Any) -> dict[str, Level]:
    return {row.kind: Level(float(row.level), bool(row.granted)) for row in rows}
