#!/usr/bin/env bash
# End-to-end training throughput on the device machine, from the repository
# root: examples/pretrain.py once per line of RUNS ("name config overrides..."),
# side by side in one session, STEPS steps each without checkpoints; their
# summaries gathered into one result, $OUT/results/pretrain-<date>-<time>.json
# (keep the cited ones in benchmarks/results/pretrain/). A log per run goes to
# $OUT/pretrain-<name>.log; PRETRAIN_CMD replaces "python -m examples.pretrain"
# (e.g. with benchmarks/run_with.py's settings). For example, cuDNN
# attention's outputs saved or recomputed in the backward pass:
#   RUNS='save_dots configs/h200.yaml train.batch_size=12
#         save_dots_attention configs/h200.yaml train.batch_size=12 model.remat_policy=save_dots_attention' \
#   bash benchmarks/gpu_pretrain.sh
source benchmarks/gpu_setup.sh
STEPS=${STEPS:-30}
RUNS=${RUNS:-"h200 configs/h200.yaml train.batch_size=6
h200_fine configs/h200_fine.yaml train.batch_size=6"}
RUN_ROOT=$(mktemp -d)
while read -r name config overrides; do
  [ -n "$name" ] || continue
  # shellcheck disable=SC2086  # PRETRAIN_CMD's words and the overrides: separate arguments
  step "pretrain-$name" "${RUN_TIMEOUT:-200}" ${PRETRAIN_CMD:-python -m examples.pretrain} \
    "$config" $overrides \
    "train.steps=$STEPS" train.checkpoint_every=0 "train.run_dir=\"$RUN_ROOT/$name\""
  echo "$name $config $overrides" >> "$RUN_ROOT/commands"
done <<< "$RUNS"
RUN_ROOT=$RUN_ROOT STEPS=$STEPS PRETRAIN_CMD=${PRETRAIN_CMD:-python -m examples.pretrain} \
  python - <<'PY'
import json, os, pathlib
from moe_ep.bench import common
root = pathlib.Path(os.environ["RUN_ROOT"])
runs, commands = {}, {}
for line in (root / "commands").read_text().splitlines():
  name, config, *overrides = line.split()
  commands[name] = " ".join([os.environ["PRETRAIN_CMD"], config, *overrides,
                             f"train.steps={os.environ['STEPS']}", "train.checkpoint_every=0"])
  summary = root / name / "summary.json"
  runs[name] = json.loads(summary.read_text()) if summary.is_file() else None
  run = runs[name]
  print(name, "failed: no summary.json" if run is None else
        ("MFU n/a, " if run["mfu"] is None else f"MFU {100 * run['mfu']:.1f}%, ") +
        f"{run['tokens_per_s']:,.0f} tokens/s, peak {run['peak_memory_bytes'] / 1e9:.1f} GB, "
        f"dropped {run['dropped_fraction']:.3f}")
print(common.write_result("pretrain", {"commands": commands, "runs": runs},
                          pathlib.Path(os.environ["OUT"]) / "results"))
PY
