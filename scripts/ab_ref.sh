#!/usr/bin/env bash
# Puts commit $1's tree in .ab_ref (git-ignored), which gpu_run.sh then builds beside the current tree and compares
# with benchmarks/ab_compare.py (AB_BENCH, default the attention forward) on the same machine. Carry ".ab_ref".
set -euo pipefail
commit=${1:?usage: scripts/ab_ref.sh <commit>}
cd "$(git rev-parse --show-toplevel)"
rm -rf .ab_ref && mkdir .ab_ref
git archive "$commit" | tar -x -C .ab_ref
rm -rf .ab_ref/.whl
git rev-parse --short "$commit" > .ab_ref/AB_COMMIT
echo "reference $(cat .ab_ref/AB_COMMIT) in .ab_ref ($(du -sh .ab_ref | cut -f1)); carry .ab_ref to the GPU host"
