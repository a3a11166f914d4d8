"""torchrun for these tests (conftest.train_cmd): its agent, like the ranks it starts, runs in a fork of the test
session's standing zygote (conftest.warm_pool), which saves the agent's imports (1-2 s of CPU per launch). Without
a pool (child_env(WARM_START_POOL="")) it is plain torchrun."""

import os

from {{ cookiecutter.project_slug }}.machinery import identity, warmstart

STAND_IN = "TEST_TORCHRUN_STAND_IN"  # in the ranks' environment: the pid the test started (conftest.worker_pids)

warmstart.handoff()  # in the zygote's child it returns: this process is the agent
# The ranks this agent starts are not its warm child: they hand themselves to the zygote as any rank does.
if stand_in := os.environ.pop(identity.ENV_WORKER, ""):
    os.environ[STAND_IN] = stand_in
os.environ.pop(identity.ENV_AGENT, None)

from torch.distributed.run import main  # noqa: E402 - after the handoff: a stand-in never imports torch

main()
