#!/usr/bin/env bash
# Start-up of two checkouts side by side: a run without SFT whose actor, reference and critic
# groups start (PPO with a critic, one step), in alternating order, REPEATS times each. Prints
# one JSON line per run: the whole process's seconds, the run's start-up total and its
# worker-group phases (summary.json's startup/*).
#
#   scripts/startup_ab.sh OLD_CHECKOUT NEW_CHECKOUT [REPEATS]     (e.g. a `git worktree` of an older commit)
#
# Both checkouts run with this checkout's .venv (PYTHONPATH points at the checkout's agentrl).
set -euo pipefail
old=$(realpath "$1"); new=$(realpath "$2"); repeats=${3:-3}
python=$(realpath "$(dirname "$0")/../.venv/bin/python")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export RAY_AUTH_MODE=disabled
for i in $(seq 1 "$repeats"); do
  if [ $((i % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    tree=$new; [ "$side" = old ] && tree=$old
    name="$side-$i"
    start=$(date +%s.%N)
    PYTHONPATH=$tree "$python" -m agentrl.cli train sft.enable=false algorithm.adv_estimator=gae critic.enable=true \
      trainer.total_steps=1 trainer.test_freq=0 trainer.val_before_train=false trainer.save_freq=0 trainer.export_hf=false \
      logging.progress=false "logging.loggers=[jsonl]" trainer.runs_root="$work" trainer.run_name="$name" > "$work/$name.log" 2>&1
    end=$(date +%s.%N)
    "$python" - "$work/$name" "$side" "$start" "$end" <<'PY'
import json, sys
run, side, start, end = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
s = json.load(open(f"{run}/summary.json"))
workers = {k: v for k, v in s.items() if k.startswith("startup/") and k.endswith("workers_s")}
print(json.dumps({"side": side, "process_s": round(end - start, 2), "startup_total_s": s["startup/total_s"],
                  "workers_s": round(sum(workers.values()), 2), "phases": workers}))
PY
  done
done
