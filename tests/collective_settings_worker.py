"""Run by tests/test_collectives_config.py under torchrun (two gloo ranks): for each case of argv[1] (JSON: a list
of {"name", "env": [rank 0's THUNDER_TK_COLLECTIVE_* and THUNDER_TK_DISABLE settings, rank 1's]}), set this rank's
variables, check them against the other rank's as `thunder-tk pretrain` does before it builds the model (a Channel
checks the THUNDER_TK_COLLECTIVE_* ones the same way) and record "ok" or the error's text; rank r writes
{name: outcome} as JSON to argv[2] + ".r"."""

import json
import os
import sys

import torch.distributed as dist

from thunder_tk.pretrain import ConfigError, check_collective_environment


def main(cases_json: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    outcomes = {}
    for case in json.loads(cases_json):
        for name in [k for k in os.environ if k.startswith(("THUNDER_TK_COLLECTIVE_", "THUNDER_TK_DISABLE"))]:
            del os.environ[name]
        os.environ.update(case["env"][rank])
        try:
            check_collective_environment(dist.get_world_size())
            outcomes[case["name"]] = "ok"
        except ConfigError as e:
            outcomes[case["name"]] = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(outcomes, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
