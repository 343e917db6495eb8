"""Run by tests/test_collectives_config.py under torchrun (two gloo ranks): for each case of argv[1] (JSON: a list
of {"name", "env": [rank 0's THUNDER_TK_COLLECTIVE_* settings, rank 1's]}), set this rank's variables, check the
settings against the other rank's (settings_on_every_rank, as Channel and `thunder-tk pretrain` do) and record
"ok" or the error's text; rank r writes {name: outcome} as JSON to argv[2] + ".r"."""

import json
import os
import sys

import torch.distributed as dist

from thunder_tk.collectives import settings_on_every_rank


def main(cases_json: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    outcomes = {}
    for case in json.loads(cases_json):
        for name in [k for k in os.environ if k.startswith("THUNDER_TK_COLLECTIVE_")]:
            del os.environ[name]
        os.environ.update(case["env"][rank])
        try:
            settings_on_every_rank()
            outcomes[case["name"]] = "ok"
        except ValueError as e:
            outcomes[case["name"]] = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(outcomes, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
