"""In-cluster entry of Ray runs: `python -m orchestrator.backends.ray_entry --spec job.yaml`.

The entrypoint of a Ray Jobs API submission (`torchrig submit --backend ray --address ...`) and of a
KubeRay RayJob (`torchrig render --target rayjob`). It connects to the Ray cluster it runs in
(`RAY_ADDRESS`, set by the Jobs API and KubeRay; else a local Ray) and runs the job with Ray Train
exactly like the local Ray backend, writing the run directory (`TORCHRIG_RUN_DIR`, default
`runs/<name>/<time>`). Exit codes: 0 succeeded, 2 bad spec, 4 the run failed after its restarts, 5 no
store committed the final checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from training.contract import Env

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.backends.ray_entry", description=__doc__)
    parser.add_argument("--spec", default=os.environ.get(Env.SPEC), help="The resolved job file.")
    parser.add_argument("--run-dir", default=os.environ.get(Env.RUN_DIR), help="Run directory.")
    parser.add_argument("--fixed-size", action="store_true", help="Run an elastic spec at nodes.max.")
    args = parser.parse_args(argv)

    from orchestrator.errors import TorchrigError
    from orchestrator.loader import load_spec

    try:
        if not args.spec:
            from orchestrator.errors import SpecError

            raise SpecError(f"--spec: required (or set {Env.SPEC})")
        spec = load_spec(args.spec)
        import ray

        from orchestrator.backends.ray_run import apply_ray_env, run_ray_train
        from orchestrator.rundir import new_run_dir

        apply_ray_env()
        if not ray.is_initialized():
            # Inside a Jobs API job or a RayJob, RAY_ADDRESS names the cluster; "auto" finds a local one.
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
        run_dir = args.run_dir or str(new_run_dir(spec.name))
        env = {k: v for k, v in os.environ.items() if k.startswith((Env.PREFIX, "RAY_TRAIN_"))}
        env[Env.RUN_DIR] = os.path.abspath(run_dir)
        summary = run_ray_train(spec, run_dir, env=env, fixed_size=args.fixed_size)
    except TorchrigError as exc:
        for line in exc.lines():
            print(f"error: {line}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(summary.to_dict(), sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
