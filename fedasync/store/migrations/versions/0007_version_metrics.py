"""model_versions.metrics: every metric the task's evaluation reports, as JSON

A task (issue 33) reports any metrics (``evaluate(model, loader) -> dict``); ``accuracy`` and
``loss`` keep their columns (NULL when the task has no such metric), the whole dict is
``metrics`` (JSON text). Rows written before keep NULL (a resume rebuilds their history from
``accuracy`` and ``loss``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 18:40:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0007'
down_revision: Union[str, Sequence[str], None] = '0006'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('model_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('metrics', sa.Text(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('model_versions', schema=None) as batch_op:
        batch_op.drop_column('metrics')
