"""strategy_state: the strategy's state, written when it changes

``runs.strategy_state`` holds the strategy's last snapshot (its ``state_dict``, with FedAvgM's
float64 velocity of the whole model), written only when an aggregation changed it; each
``runs.loop_state`` refers to it by id, so a reply that only buffers an update, and a batch of
dispatches, no longer re-encode the strategy. NULL for runs written before (their loop_state
embeds the strategy, still read). The downgrade puts each run's snapshot back into its loop
state (where the code of 0008 reads it) before dropping the column, so no run loses it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 20:45:00

"""
import json
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0009'
down_revision: Union[str, Sequence[str], None] = '0008'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('strategy_state', sa.Text(), nullable=True))


def downgrade() -> None:
    """Downgrade schema: the loop state's ``strategy_snapshot`` (an id) becomes ``strategy`` (the
    snapshot's state), at the JSON level of ``dumps_state`` (``{"__dict__": [[key, value], ...]}``)."""
    conn = op.get_bind()
    runs = sa.table('runs', sa.column('id', sa.Integer), sa.column('loop_state', sa.Text),
                    sa.column('strategy_state', sa.Text))
    ids = conn.execute(sa.select(runs.c.id).where(runs.c.strategy_state.is_not(None),
                                                  runs.c.loop_state.is_not(None))).scalars().all()
    for run_id in ids:  # one run's texts at a time (a snapshot holds the model's velocity)
        loop_text, snap_text = conn.execute(sa.select(runs.c.loop_state, runs.c.strategy_state)
                                            .where(runs.c.id == run_id)).one()
        loop = json.loads(loop_text)
        pairs = loop.get("__dict__") if isinstance(loop, dict) else None
        if not pairs or "strategy_snapshot" not in {k for k, _ in pairs}:
            continue
        state = dict(json.loads(snap_text)["__dict__"])["state"]
        loop["__dict__"] = [["strategy", state] if k == "strategy_snapshot" else [k, v] for k, v in pairs]
        conn.execute(runs.update().where(runs.c.id == run_id).values(loop_state=json.dumps(loop)))
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('strategy_state')
