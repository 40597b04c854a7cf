"""run_key: each run's random identifier, which signed updates cover

``runs.run_key`` (32 lowercase hex digits, ``secrets.token_hex(16)``) binds a signed update to
one run of one store: ``runs.id`` is 1 in every fresh store, so a reply signed for one
deployment verified in another. Runs written before get a fresh random key here (their
in-flight replies, signed without one, no longer verify: such a run resumes by sending its
tasks again).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06 17:40:00

"""
import secrets
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0006'
down_revision: Union[str, Sequence[str], None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('run_key', sa.String(length=32), nullable=True))
    conn = op.get_bind()
    runs = sa.table('runs', sa.column('id', sa.Integer), sa.column('run_key', sa.String(32)))
    for (run_id,) in conn.execute(sa.select(runs.c.id)).all():
        conn.execute(runs.update().where(runs.c.id == run_id).values(run_key=secrets.token_hex(16)))
    # nullable, as in schema.py: making it NOT NULL would make SQLite recreate ``runs``, and with
    # foreign keys on, dropping the old table deletes every row that refers to a run (ON DELETE
    # CASCADE). Store.create_run always sets it.


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('run_key')
