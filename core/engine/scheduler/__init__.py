"""The scheduler: continuous batching over managers that own their state (scheduler.py says
which). Imported as `core.engine.scheduler`."""

from core.engine.scheduler.request import (
    CLIP_MAX_NEW_TOKENS,
    AdmissionError,
    Req,
    SchedulerConfig,
    check_fits,
)
from core.engine.scheduler.scheduler import Scheduler

__all__ = ["AdmissionError", "CLIP_MAX_NEW_TOKENS", "Req", "Scheduler", "SchedulerConfig",
           "check_fits"]
