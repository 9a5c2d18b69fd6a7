"""`python -m training --spec job.yaml`: the worker entry point under every launcher.

It loads the job (`training.entry.load_invocation`: `--spec`/`TORCHRIG_SPEC`, `--run-dir`/
`TORCHRIG_RUN_DIR`) and then either runs its role (`training.entry.run`, whose docstring lists the exit
codes) or, with `restarts.mode: inplace` under torchrig's torchrun command, becomes the rank's host and
runs the trainer as its child (`training.inplace.host`). The host's children run `training.entry`
directly, never this module.
"""

from __future__ import annotations

import sys

from training.entry import load_invocation, run


def main(argv: list[str] | None = None) -> int:
    """Load the job and run this process: the in-place host of its rank, or its role. Returns the exit code."""
    invocation = load_invocation(argv)
    if isinstance(invocation, int):
        return invocation
    if not invocation.role:
        from training.inplace import InPlace

        inplace = InPlace.from_spec(invocation.spec)
        if inplace is not None:
            # In-place recovery: this process is the rank's light host; the trainer is its child.
            from training.inplace.host import run_host

            return run_host(inplace, sys.argv[1:] if argv is None else list(argv))
    return run(invocation)


if __name__ == "__main__":
    from training.fastexit import exit_now

    exit_now(main())  # without the ~1 s interpreter teardown (training.fastexit)
