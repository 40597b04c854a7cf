"""Client-level central DP for FedBuff's buffered aggregation (the Gaussian mechanism). Pure numpy.

:class:`CentralDP` clips, weights, sums and noises the buffered deltas of one release;
:class:`fedasync.server.strategies.FedBuff` calls it and holds back a client's second update so
that a release has at most one term per client.
"""

from __future__ import annotations

import secrets
from typing import Any, Sequence

import numpy as np

from fedasync.server.params import Params, Params64, _check_like, params_norm


class CentralDP:
    """Client-level central DP for buffered aggregation (the Gaussian mechanism).

    ``privatize`` clips each delta to global L2 norm ``clip``, multiplies it by its weight
    (the staleness weight, ``<= 1``, so the sensitivity stays ``clip``), sums, and adds
    ``N(0, (noise_multiplier * clip)^2)`` to every coordinate, drawn in key order.
    ``releases`` counts the noisy sums released (for the accountant).

    Where the noise comes from: by default (``reproducible=False``) a numpy ``PCG64`` generator
    seeded with 128 bits of OS entropy (:func:`secrets.randbits`) when this object is made;
    ``reproducible=True`` (``privacy.reproducible_noise``) derives release ``r``'s noise from
    ``(seed, r)``.  No generator state is ever persisted (:meth:`state_dict` holds only the
    release count): a stored state would let anyone who reads the database regenerate the
    noise and subtract it from the stored model versions.  So a resumed run draws fresh
    entropy (secret noise), or re-derives each release's noise from the seed and the release
    index (reproducible noise: a resumed run ends with the same model as one never stopped).
    PCG64 is not a cryptographically secure generator; see the README's privacy section.
    """

    def __init__(self, clip: float, noise_multiplier: float, seed: int = 0, reproducible: bool = False) -> None:
        if clip <= 0:
            raise ValueError(f"central DP clip must be > 0, got {clip}")
        if noise_multiplier < 0:
            raise ValueError(f"central DP noise_multiplier must be >= 0, got {noise_multiplier}")
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.seed = int(seed)
        self.reproducible = bool(reproducible)
        self._secret = None if self.reproducible else np.random.default_rng(secrets.randbits(128))
        self.releases = 0

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.clip

    def noise_rng(self) -> np.random.Generator:
        """The generator for the next release (see the class docstring)."""
        if self._secret is not None:
            return self._secret
        return np.random.default_rng(np.random.SeedSequence([self.seed % 2**64, 0xCE17, self.releases]))

    def clip_delta(self, delta: Params) -> Params64:
        """``delta * min(1, clip / ||delta||)`` in float64."""
        norm = params_norm(delta)
        factor = 1.0 if norm <= self.clip else self.clip / norm
        return {k: np.asarray(v, np.float64) * factor for k, v in delta.items()}

    def privatize(
        self,
        deltas: Sequence[Params],
        rng: np.random.Generator | None = None,
        *,
        weights: Sequence[float] | None = None,
    ) -> Params64:
        """The noisy sum ``sum_i w_i clip(delta_i) + N(0, std^2 I)`` (float64)."""
        if not deltas:
            raise ValueError("privatize: no deltas")
        rng = self.noise_rng() if rng is None else rng
        weights = [1.0] * len(deltas) if weights is None else list(weights)
        if len(weights) != len(deltas):
            raise ValueError("privatize: one weight per delta")
        total = {k: np.zeros(np.shape(v), np.float64) for k, v in deltas[0].items()}
        for d, w in zip(deltas, weights):
            _check_like(total, d, "central DP delta")
            for k, v in self.clip_delta(d).items():
                total[k] += w * v
        std = self.noise_std
        for k in total:
            total[k] = total[k] + rng.normal(0.0, std, size=total[k].shape)
        self.releases += 1
        return total

    def state_dict(self) -> dict[str, Any]:
        """The release count only: never the generator (see the class docstring)."""
        return {"releases": self.releases, "reproducible": self.reproducible}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.releases = int(d["releases"])  # a state from before 0.x may carry "bit_generator": ignored
