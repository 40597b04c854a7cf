"""evaluations: every row of a run's history, with the virtual time it stands for

The evaluation grid (``server.eval_every_s``) records one evaluation per grid time, and several
grid times may share a model version (FedAvg between rounds), so evaluations can no longer be
columns of ``model_versions`` alone. Each is a row here (version, virtual time, accuracy, loss,
every metric as JSON); ``model_versions.accuracy/loss/metrics`` keep the version's latest
evaluation. Runs written before keep their history in ``model_versions`` (a resume reads it
from there when a run has no row here).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 20:00:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0008'
down_revision: Union[str, Sequence[str], None] = '0007'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('evaluations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('virtual_time', sa.Float(), nullable=False),
    sa.Column('accuracy', sa.Float(), nullable=True),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('metrics', sa.Text(), nullable=True),
    sa.Column('recorded_wall', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.create_index('ix_evaluations_run', ['run_id'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.drop_index('ix_evaluations_run')
    op.drop_table('evaluations')
