"""The RL run as a library object (`RLSession`): what `simloop train-agent` and `simloop
demo` run once the job has parsed its config, planned its chips and knows how to open its
servers. It sits between the jobs (`launch`) and the trainers and orchestrator it drives
(`rl.train`, `rl.orchestrator`), takes their typed configs and factories, and decides what
each process of a multi-process job does (`rl/session/run.py`)."""

from rl.session.cotrain import GatedRun, SimCoTraining
from rl.session.harness import HarnessSetup, HarnessUnusable
from rl.session.publish import Published, VersionTagged
from rl.session.run import (
    REFERENCE,
    RLSession,
    Servers,
    SessionError,
    published_roles,
    server_roles,
)

__all__ = [
    "REFERENCE",
    "GatedRun",
    "HarnessSetup",
    "HarnessUnusable",
    "Published",
    "RLSession",
    "Servers",
    "SessionError",
    "SimCoTraining",
    "VersionTagged",
    "published_roles",
    "server_roles",
]
