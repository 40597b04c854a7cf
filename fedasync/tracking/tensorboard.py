"""The TensorBoard tracker (tensorboardX, ``pip install fedasync[tensorboard]``): event files in
``<run dir>/tensorboard``. Each scalar at ``global_step`` = the evaluation's index (the model
version is the scalar ``async/version``) with the virtual time
as its wall time (TensorBoard's "relative" axis is simulated seconds); per-client figures as
histograms; the resolved config as hparams (the final evaluation's metrics as their metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams


class TensorBoardTracker:
    """Writes one run's records to ``logdir``."""

    def __init__(self, logdir: Path):
        self.logdir = Path(logdir)
        self.writer = SummaryWriter(logdir=str(self.logdir), flush_secs=3600)
        self.last: dict[str, float] = {}

    def log_params(self, params: dict[str, Any]) -> None:
        self.params = params  # written with the final metrics in close(): hparams need both

    def log_step(self, step: int, time_s: float, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
        for tag, v in scalars.items():
            self.writer.add_scalar(tag, float(v), global_step=step, walltime=time_s)
            if tag.startswith("eval/"):
                self.last[tag] = float(v)
        for tag, values in histograms.items():
            if values:
                self.writer.add_histogram(tag, np.asarray(values, dtype=np.float64), global_step=step, walltime=time_s)

    def log_model(self, path: Path) -> None:  # TensorBoard keeps no artifacts
        pass

    def flush(self) -> None:  # live tracking: what was logged is on disk for `tensorboard --logdir`
        self.writer.flush()

    def close(self) -> None:
        params = getattr(self, "params", None)
        if params is not None:
            exp, ssi, sei = hparams(params, self.last)
            fw = self.writer._get_file_writer()
            for s in (exp, ssi, sei):
                fw.add_summary(s)
        self.writer.close()
