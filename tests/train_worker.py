"""Run `steps` training steps through llmz.trainer.Trainer and write what the tests compare:
OUT/params_rank{r}.npy (final parameters, full precision), OUT/result_rank{r}.json (losses, grad norms,
memory report, communication counters). LLMZ_TEST_FAIL=rank=R,step=S raises on rank R at step S. Usage: [mpiexec -n N] python tests/train_worker.py OUT [train flags]"""
import json
import os
import sys

import numpy as np


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    from llmz.train import parse_args
    args, kind = parse_args(argv)
    from llmz.run.launch import abort_on_error, init_ranks
    ranks = init_ranks()
    with abort_on_error(ranks):
        from llmz.trainer import Trainer
        run = Trainer(args, kind, ranks)
        losses, norms = [], []
        run.comm.reset_counters()
        rs_in_backward = []
        fail = dict(kv.split("=") for kv in os.environ.get("LLMZ_TEST_FAIL", "").split(",") if kv)
        for step in range(args.steps):
            if fail and int(fail["rank"]) == ranks.rank and int(fail["step"]) == step:
                raise RuntimeError(f"injected failure at step {step}")
            before = getattr(run.zero, "reduce_scatters_in_backward", 0)
            r = run.step(step)
            rs_in_backward.append(getattr(run.zero, "reduce_scatters_in_backward", 0) - before)
            losses.append(r["loss"])
            norms.append(r["grad_norm"])
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, f"params_rank{ranks.rank}.npy"), run.host_params())
        result = {"losses": losses, "grad_norms": norms, "memory": run.memory,
                  "comm_calls": dict(run.comm.calls), "comm_bytes": run.comm.bytes_sent,
                  "reduce_scatters_in_backward": rs_in_backward, "world_size": ranks.world_size}
        with open(os.path.join(out, f"result_rank{ranks.rank}.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
