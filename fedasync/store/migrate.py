"""Schema management. (Alembic migrations replace create_all once the schema is versioned.)"""

from __future__ import annotations

from sqlalchemy.engine import Engine

from fedasync.store.schema import Base


def upgrade(engine: Engine) -> None:
    """Bring the database at ``engine`` to the current schema."""
    Base.metadata.create_all(engine)
