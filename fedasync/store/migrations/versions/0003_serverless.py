"""serverless: ledger and gossip tables (fedasync.store.serverless_schema)

FLchain: ledger_blocks (UNIQUE run_id, height), ledger_payloads (by sha256), ledger_evals;
gossip: gossip_models (one row per peer), gossip_events, gossip_metrics;
both: serverless_runs (what every peer agrees on), serverless_peers (who is ready, counts).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 16:48:52.516219

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0003'
down_revision: Union[str, Sequence[str], None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('ledger_payloads',
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('data', sa.LargeBinary(), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('sha256')
    )
    op.create_table('gossip_events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('peer_id', sa.Integer(), nullable=False),
    sa.Column('neighbour_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('peer_version', sa.Integer(), nullable=False),
    sa.Column('neighbour_version', sa.Integer(), nullable=False),
    sa.Column('base_version', sa.Integer(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('epsilon', sa.Float(), nullable=True),
    sa.Column('virtual_time', sa.Float(), nullable=False),
    sa.Column('wall_time', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('gossip_events', schema=None) as batch_op:
        batch_op.create_index('ix_gossip_events_run', ['run_id', 'id'], unique=False)

    op.create_table('gossip_metrics',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('events', sa.Integer(), nullable=False),
    sa.Column('time_s', sa.Float(), nullable=False),
    sa.Column('accuracy', sa.Float(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=False),
    sa.Column('min_accuracy', sa.Float(), nullable=False),
    sa.Column('max_accuracy', sa.Float(), nullable=False),
    sa.Column('consensus_distance', sa.Float(), nullable=False),
    sa.Column('recorded_wall', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('gossip_models',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('peer_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('params', sa.LargeBinary(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('updated_virtual', sa.Float(), nullable=False),
    sa.Column('updated_wall', sa.Float(), nullable=False),
    sa.Column('exhausted', sa.Boolean(), nullable=False),
    sa.Column('exhausted_reason', sa.String(length=200), nullable=True),
    sa.Column('epsilon', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'peer_id', name='uq_gossip_models_run_peer')
    )
    op.create_table('ledger_blocks',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('height', sa.Integer(), nullable=False),
    sa.Column('prev_hash', sa.String(length=64), nullable=False),
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=10), nullable=False),
    sa.Column('payload_sha256', sa.String(length=64), nullable=False),
    sa.Column('meta_json', sa.Text(), nullable=False),
    sa.Column('public_key', sa.String(length=64), nullable=False),
    sa.Column('signature', sa.String(length=128), nullable=False),
    sa.Column('created', sa.Float(), nullable=False),
    sa.Column('created_wall', sa.Float(), nullable=False),
    sa.Column('peer_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'height', name='uq_ledger_blocks_run_height')
    )
    with op.batch_alter_table('ledger_blocks', schema=None) as batch_op:
        batch_op.create_index('ix_ledger_blocks_run_kind', ['run_id', 'kind'], unique=False)

    op.create_table('ledger_evals',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('height', sa.Integer(), nullable=False),
    sa.Column('model_index', sa.Integer(), nullable=False),
    sa.Column('accuracy', sa.Float(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=False),
    sa.Column('evaluated_wall', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'height')
    )
    op.create_table('serverless_peers',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('peer_id', sa.Integer(), nullable=False),
    sa.Column('public_key', sa.String(length=64), nullable=True),
    sa.Column('host', sa.String(length=200), nullable=True),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('ready_wall', sa.Float(), nullable=False),
    sa.Column('finished_wall', sa.Float(), nullable=True),
    sa.Column('stop_reason', sa.String(length=200), nullable=True),
    sa.Column('stats_json', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'peer_id')
    )
    op.create_table('serverless_runs',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=10), nullable=False),
    sa.Column('num_peers', sa.Integer(), nullable=False),
    sa.Column('topology', sa.String(length=20), nullable=True),
    sa.Column('settings_json', sa.Text(), nullable=False),
    sa.Column('clock', sa.String(length=10), nullable=False),
    sa.Column('started_wall', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id')
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table('serverless_runs')
    op.drop_table('serverless_peers')
    op.drop_table('ledger_evals')
    with op.batch_alter_table('ledger_blocks', schema=None) as batch_op:
        batch_op.drop_index('ix_ledger_blocks_run_kind')

    op.drop_table('ledger_blocks')
    op.drop_table('gossip_models')
    op.drop_table('gossip_metrics')
    with op.batch_alter_table('gossip_events', schema=None) as batch_op:
        batch_op.drop_index('ix_gossip_events_run')

    op.drop_table('gossip_events')
    op.drop_table('ledger_payloads')
