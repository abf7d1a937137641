"""File metadata for the OpenAI Files API: create, get, list, delete.

Only the metadata lives here; the gateway stores each file's content itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, fields

from sqlalchemy import delete, func, insert, select

from tokenfleet.batch.database import QuotaExceeded, StoreBase, keyset
from tokenfleet.batch.schema import FileRow, files
from tokenfleet.errors import InvalidRequestError

_FILE_COLUMNS = [files.c[f.name] for f in fields(FileRow)]


class FilesMixin(StoreBase):
    """The file methods of BatchStore."""

    def create_file(
        self, file: FileRow, max_bytes: int | None = None, quota_owners: Sequence[str] = ()
    ) -> None:
        """Records an uploaded file's metadata (the gateway has stored its content).

        `max_bytes`: the quota of stored bytes of the owner, or of `quota_owners` together
        (a key group), this file's included; over it, nothing is recorded and
        QuotaExceeded is raised."""
        with self.engine.begin() as conn:
            conn.execute(insert(files).values(asdict(file)))
            if max_bytes is not None:
                owners = quota_owners or (file.owner,)
                stored = int(
                    conn.execute(
                        select(func.coalesce(func.sum(files.c.bytes), 0)).where(
                            files.c.owner.in_(owners)
                        )
                    ).scalar_one()
                )
                if stored > max_bytes:
                    raise QuotaExceeded(
                        f"this file would bring your stored files to {stored} bytes, over "
                        f"your quota of {max_bytes}; delete files you no longer need",
                        queued=stored - file.bytes,
                        quota=max_bytes,
                    )

    def get_file(self, file_id: str, owner: str) -> FileRow | None:
        """The file, or None when there is none or it is another owner's."""
        with self._reader.begin() as conn:
            row = conn.execute(
                select(*_FILE_COLUMNS).where(files.c.id == file_id, files.c.owner == owner)
            ).first()
        return None if row is None else FileRow(*row)

    def list_files(
        self,
        owner: str,
        purpose: str | None = None,
        limit: int = 10_000,
        after: str | None = None,
    ) -> tuple[list[FileRow], bool]:
        """One page of this owner's files, newest first, and whether more follow.

        `after`: the id of the last file of the previous page.
        """
        c = files.c
        query = select(*_FILE_COLUMNS).where(c.owner == owner)
        if purpose is not None:
            query = query.where(c.purpose == purpose)
        with self._reader.begin() as conn:
            if after is not None:
                cursor = conn.execute(
                    select(c.created_at, c.id).where(c.id == after, c.owner == owner)
                ).first()
                if cursor is None:
                    raise InvalidRequestError(f"no file {after!r} to page from", param="after")
                query = query.where(keyset((c.created_at, c.id), tuple(cursor), older=True))
            rows = conn.execute(
                query.order_by(c.created_at.desc(), c.id.desc()).limit(limit + 1)
            ).all()
        return [FileRow(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str) -> bool:
        """Forgets the file's metadata; False when there is no such file of this owner."""
        with self.engine.begin() as conn:
            return bool(
                conn.execute(
                    delete(files).where(files.c.id == file_id, files.c.owner == owner)
                ).rowcount
            )
