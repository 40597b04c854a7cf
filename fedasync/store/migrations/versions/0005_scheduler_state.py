"""scheduler_state: the scheduler's per-client state, written whole now and then

``runs.scheduler_state`` holds a snapshot of the scheduler's per-client statistics (dispatch
counts, observed durations, remaining budgets); ``runs.loop_state`` holds what changed since,
so a reply's transaction no longer rewrites state that grows with the clients seen. NULL for
runs written before (their loop_state holds the whole scheduler state, still read).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06 03:50:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0005'
down_revision: Union[str, Sequence[str], None] = '0004'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('scheduler_state', sa.Text(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('scheduler_state')
