"""replays: replies that matched no open task (replayed or for a closed task)

``updates`` keeps ``UNIQUE(run_id, task_id)``: the one reply that closed a task. Anything
that arrives for that task afterwards is recorded here with reason ``replay``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 16:40:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0002'
down_revision: Union[str, Sequence[str], None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('replays',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('task_id', sa.Integer(), nullable=True),
    sa.Column('client_id', sa.Integer(), nullable=True),
    sa.Column('message_id', sa.String(length=100), nullable=True),
    sa.Column('reason', sa.String(length=100), nullable=False),
    sa.Column('params_sha256', sa.String(length=64), nullable=True),
    sa.Column('received_virtual', sa.Float(), nullable=False),
    sa.Column('received_wall', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('replays', schema=None) as batch_op:
        batch_op.create_index('ix_replays_run', ['run_id'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('replays', schema=None) as batch_op:
        batch_op.drop_index('ix_replays_run')
    op.drop_table('replays')
