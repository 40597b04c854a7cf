"""filter_params: the update a robust filter remembers per client (kardam), for a resume

``updates.filter_params`` holds the parameters of each client's last update that the kardam
filter judged (its previous pseudo-gradient is recomputed from them and the stored base
version); the client's next judged update clears it. NULL everywhere else.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05 20:00:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0004'
down_revision: Union[str, Sequence[str], None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('updates', schema=None) as batch_op:
        batch_op.add_column(sa.Column('filter_params', sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('updates', schema=None) as batch_op:
        batch_op.drop_column('filter_params')
