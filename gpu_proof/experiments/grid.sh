#!/usr/bin/env bash
# The H100 grid behind config/tiny.yaml's training settings (3 seeds x 4 settings, 12 processes on one GPU).
cd "$(dirname "$0")/../.."
run() { name=$1; shift; python3 gpu_proof/experiments/train_curves.py . /tmp/x/$name --device cuda --eval 1 "$@" > $OUT/$name.log 2>&1; }
for seed in 0 1 2; do
  run a200lr2s$seed --steps 200 --lr 0.002 --seed $seed &
  run b300lr2s$seed --steps 300 --lr 0.002 --seed $seed &
  run c250lr3s$seed --steps 250 --lr 0.003 --seed $seed &
  run d400lr2s$seed --steps 400 --lr 0.002 --seed $seed &
done
wait
for f in $OUT/*.log; do echo "$(basename $f .log) $(grep -oE '"final_loss": [0-9.]+' $f) $(grep -E '^(MC|THINK)' $f | cut -d"'" -f1 | tr '\n' ' ')"; done
