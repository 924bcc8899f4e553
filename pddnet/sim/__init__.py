"""A cluster-scale discrete-event simulator on pddnet's real sans-IO parts.

:class:`Simulation` drives pddnet's :class:`~pddnet.route.Router`, the
:class:`~pddnet.handoff.RelayHandoff` and :class:`~pddnet.handoff.MainHandoff`
machines, MD's :class:`~pddnet.cache.CacheServer` and P's
:class:`~pddnet.cache.CacheMirror`, and the WAN sender's
:class:`~pddnet.transport.wan.Scheduler`, on simulated time, with modelled
engines (:class:`EngineModel`), link (:class:`WanModel`) and cost
(:class:`HardwareModel`). ``pddnet sim`` runs it; docs/sim.md describes the
models and where their parameters come from.
"""

from ._config import SimConfig, SimConfigError, load_config
from ._models import EngineModel, HardwareModel, WanModel
from ._report import SOURCE_RESULTS, compare, run_metrics, run_pair, sweep, workload_for
from ._sim import EventLoop, RequestResult, RunResult, Simulation
from ._workload import Turn, Workload, session_tokens

__all__ = [
    "SOURCE_RESULTS",
    "EngineModel",
    "EventLoop",
    "HardwareModel",
    "RequestResult",
    "RunResult",
    "SimConfig",
    "SimConfigError",
    "Simulation",
    "Turn",
    "WanModel",
    "Workload",
    "compare",
    "load_config",
    "run_metrics",
    "run_pair",
    "session_tokens",
    "sweep",
    "workload_for",
]
