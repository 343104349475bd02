"""Run by a Slurm trial's batch shell on ``USR1`` (the time limit is near): tell the engine over
the run's own session (its token, from the job's environment) that the run ends soon; the
engine asks the trial to checkpoint and queues it again. ``python -m det_local.slurm.notify``.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from det_local.trial.session import Session

    what = argv[0] if argv else "time_limit"
    env = os.environ
    try:
        session = Session(
            env["DET_LOCAL_SOCKET"],
            env["DET_LOCAL_TOKEN"],
            int(env["DET_TRIAL_ID"]),
            int(env["DET_TRIAL_RUN_ID"]),
            rank=-1,
        )
        session.request(what)
        session.close()
    except Exception as err:  # noqa: BLE001 - said in the job's log; the shell goes on
        print(f"det-local: could not tell the engine the job ends soon: {err}", file=sys.stderr)
        return 1
    print(
        f"det-local: Slurm job {env.get('SLURM_JOB_ID')} ends soon: checkpointing to continue "
        "in a new job",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
