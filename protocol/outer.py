"""The outer optimizer: SGD with Nesterov momentum on an fp32 global copy.

In DiLoCo (Douillard et al., arXiv 2311.08105) each replica runs ``H`` inner steps from
the global parameters ``theta_old``; the averaged pseudo-gradient
``delta = theta_old - theta_local`` ("old global minus new local", the sign of a
gradient) is then fed as the gradient of an outer SGD with Nesterov momentum (lr 0.7,
momentum 0.9 in the paper). Streaming DiLoCo (arXiv 2501.18512) keeps one global copy and
one outer-optimizer state per fragment; this module holds one such state, for one flat
float32 vector.

The update is the one of ``torch.optim.SGD`` with ``dampening=0`` and
``weight_decay=0``::

    buf    = g                      on the first step
    buf    = mu * buf + g           afterwards
    update = g + mu * buf           with Nesterov, else buf
    params = params - lr * update

so that with ``lr = 1`` and ``momentum = 0`` the new global copy is exactly the mean of
the replicas' local copies. Everything is numpy; no torch is imported.

The settings are the run's: ``outer_lr``, ``outer_momentum`` and ``nesterov`` of
:class:`~atoll.protocol.manifest.OuterLoop`, which declares and checks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import OuterLoop

__all__ = ["OuterSGD"]

_STATE_KEYS = frozenset({"numel", "steps", "momentum_buffer"})


class OuterSGD:
    """SGD with (Nesterov) momentum on an fp32 flat global copy.

    The pseudo-gradient ``delta = old_global - new_local`` is its gradient. One instance
    serves one fragment: ``numel`` is the length of that fragment's flat vector; ``config``
    (default: DiLoCo's lr 0.7, momentum 0.9, Nesterov) gives ``outer_lr``,
    ``outer_momentum`` and ``nesterov``. The
    momentum buffer is float32, like the global copy (arXiv 2311.08105 keeps both in fp32).
    """

    __slots__ = ("_buf", "_config", "_numel", "_steps")

    def __init__(self, numel: int, config: OuterLoop | None = None) -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ConfigError(f"numel must be an int >= 1, got {numel!r}")
        if config is None:
            config = OuterLoop()
        if not isinstance(config, OuterLoop):
            raise ConfigError(f"config must be an OuterLoop, got {type(config).__name__}")
        self._numel = numel
        self._config = config
        self._buf: npt.NDArray[np.float32] = np.zeros(numel, dtype=np.float32)
        self._steps = 0

    @property
    def numel(self) -> int:
        """Length of the flat vector this optimizer updates."""
        return self._numel

    @property
    def config(self) -> OuterLoop:
        """The settings this optimizer was built with."""
        return self._config

    @property
    def steps(self) -> int:
        """Number of outer steps applied so far."""
        return self._steps

    @property
    def momentum(self) -> npt.NDArray[np.float32]:
        """The momentum buffer itself, read-only (:meth:`state_dict` gives a copy)."""
        view = self._buf.view()
        view.flags.writeable = False
        return view

    def step(self, params: npt.NDArray[np.float32], grad: npt.NDArray[Any]) -> None:
        """Apply one outer step to ``params`` in place, with ``grad`` as the gradient.

        ``params`` must be a writable 1-D float32 array of ``numel`` elements; ``grad`` a
        1-D floating array of the same length (float64 or float16 is cast to float32).
        ConfigError on any mismatch; nothing is changed then.
        """
        n = self._numel
        if not isinstance(params, np.ndarray) or params.dtype != np.float32:
            raise ConfigError(f"params must be a float32 numpy array, got {_describe(params)}")
        if params.shape != (n,):
            raise ConfigError(f"params must have shape ({n},), got {params.shape}")
        if not params.flags.writeable:
            raise ConfigError("params must be writable (the step is applied in place)")
        if not isinstance(grad, np.ndarray) or not np.issubdtype(grad.dtype, np.floating):
            raise ConfigError(f"grad must be a floating numpy array, got {_describe(grad)}")
        if grad.shape != (n,):
            raise ConfigError(f"grad must have shape ({n},), got {grad.shape}")

        cfg = self._config
        mu = np.float32(cfg.outer_momentum)
        g = grad.astype(np.float32, copy=False)
        buf = self._buf
        if self._steps == 0:
            np.copyto(buf, g)
        else:
            buf *= mu
            buf += g
        if cfg.nesterov:
            update = np.multiply(buf, mu)
            update += g
        else:
            update = buf.copy()
        update *= np.float32(cfg.outer_lr)
        params -= update
        self._steps += 1

    def state_dict(self) -> dict[str, object]:
        """A copy of the state: ``numel``, ``steps`` and ``momentum_buffer`` (float32)."""
        return {
            "numel": self._numel,
            "steps": self._steps,
            "momentum_buffer": self._buf.copy(),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore a state produced by :meth:`state_dict`; ConfigError if it does not fit.

        The configuration is not part of the state: it is the one given at construction.
        """
        if not isinstance(state, Mapping) or set(state.keys()) != _STATE_KEYS:
            got = sorted(state.keys()) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(f"outer state must have keys {sorted(_STATE_KEYS)}, got {got}")
        numel = state["numel"]
        steps = state["steps"]
        buf = state["momentum_buffer"]
        if numel != self._numel:
            raise ConfigError(f"outer state is for numel={numel!r}, this one has {self._numel}")
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 0:
            raise ConfigError(f"outer state steps must be an int >= 0, got {steps!r}")
        if not isinstance(buf, np.ndarray) or buf.dtype != np.float32:
            raise ConfigError(
                f"outer momentum_buffer must be a float32 numpy array, got {_describe(buf)}"
            )
        if buf.shape != (self._numel,):
            raise ConfigError(
                f"outer momentum_buffer must have shape ({self._numel},), got {buf.shape}"
            )
        self._buf = buf.copy()
        self._steps = int(steps)


def _describe(x: object) -> str:
    if isinstance(x, np.ndarray):
        return f"ndarray of dtype {x.dtype} and shape {x.shape}"
    return type(x).__name__
