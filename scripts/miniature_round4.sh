#!/usr/bin/env bash
# Round four's B-long (docs/miniature.md, "Round four"): every run resumable, run in chunks of
# under 10 minutes under the machine's shared CPU lock (/work/bin/heavy), each phase's results
# committed as they complete. Run it in the background from the repository root:
#
#   nohup scripts/miniature_round4.sh warm      > runs/round4-warm.log 2>&1 &   # 2 warm starts
#   nohup scripts/miniature_round4.sh calibrate > runs/round4-cal.log 2>&1 &    # binary only
#   nohup scripts/miniature_round4.sh main      > runs/round4-main.log 2>&1 &   # the 20 runs
#
# Rerunning a phase resumes it (finished runs are skipped, a cut run continues from its last
# saved step, a cut warm start from its last SFT snapshot). CODE (default: this checkout) is
# the checkout whose gagar_jax and scripts run: point it at a frozen copy (`git archive`) so
# that edits to the working tree cannot reach a running sweep. Without /work/bin/heavy (another
# machine) set HEAVY= to run the chunks directly.
set -u
PHASE=${1:?usage: miniature_round4.sh warm|calibrate|main}
WT=$(pwd)
CODE=${CODE:-$WT}
HEAVY=${HEAVY-/work/bin/heavy}
CHUNK_MIN=${CHUNK_MIN:-7}            # minutes of work per process (plus start-up)
OUT=$WT/docs/miniature/round4/B-long
export JAX_PLATFORMS=cpu JAX_COMPILATION_CACHE_DIR=$WT/.cache/jax PYTHONPATH=$CODE
B=(--workdir "$WT/runs/round4-B" --task hard --recipe round3b --factor-table harsh
   --steps 120 --groups 8 --group-size 8 --eval-tasks 8 --eval-every 10
   --sft-steps 2000 --sft-lr 5e-3 --set train.mini_batches=4 --set optim.learning_rate=5e-4
   --independent-warm --warm-mod 2 --flaky-target 0.5)

chunked() {   # one resumable command, a chunk at a time, until it finishes (exit 0)
  local fails=0 rc
  while true; do
    $HEAVY timeout 900 "$WT/.venv/bin/python" "$CODE/scripts/miniature.py" "$@" \
      --max-minutes "$CHUNK_MIN"
    rc=$?
    [ "$rc" -eq 0 ] && return 0
    if [ "$rc" -ne 3 ]; then        # 3 = stopped at its deadline, progress saved
      fails=$((fails + 1))
      echo "$(date -Is) chunk failed (exit $rc, failure $fails): $*"
      [ "$fails" -ge 3 ] && { echo "giving up"; exit 1; }
      sleep 30
    fi
  done
}

commit() {    # commit one results folder (retried: the author may be committing too)
  local i
  for i in 1 2 3 4 5; do
    git -C "$WT" add -- "$1" && git -C "$WT" commit -q -m "$2" -- "$1" && return 0
    git -C "$WT" diff --cached --quiet -- "$1" && git -C "$WT" diff --quiet -- "$1" && return 0
    sleep 20
  done
  echo "could not commit $1"
}

case "$PHASE" in
  warm)        # WARM_SEEDS="1" runs one (two loops may run side by side, one seed each)
    for w in ${WARM_SEEDS:-0 1}; do
      chunked --calibrate --warm-seed "$w" "${B[@]}" --eval-tasks 16
    done ;;
  calibrate)   # 40 steps of binary on warm start 0 (the steps flag given last wins)
    chunked --out "$OUT/calibration" --arms binary --seeds 0 --top-p 0.9 "${B[@]}" --steps 40
    commit "$OUT/calibration" "round four B-long: binary calibration run (flaky target 0.5)" ;;
  main)        # seeds of warm start 0 first; a seed waits for its warm start's pickle
    for s in 0 2 1 3; do
      while [ ! -e "$WT/runs/round4-B/warm-$((s % 2)).pkl" ]; do sleep 60; done
      chunked --out "$OUT/topp" --arms downweight_only,sum_preserving,length_aware \
        --seeds "$s" --top-p 0.9 "${B[@]}"
      commit "$OUT/topp" "round four B-long: top-p runs of seed $s"
      chunked --out "$OUT/exact" --arms downweight_only,sum_preserving --seeds "$s" \
        --top-p 1.0 "${B[@]}"
      commit "$OUT/exact" "round four B-long: untruncated runs of seed $s"
    done ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
echo "$(date -Is) phase $PHASE done"
