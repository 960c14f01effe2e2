#!/usr/bin/env bash
# The trees run1/command.sh (and run1b.sh) compare against this one, as archives at the repository root (untracked;
# the device call copies the working tree with them; delete them after the call):
#   session_base.tgz   41c7a1e, the tree before the quantized GEMV qgemv.cu (the old FP8 GEMV);
#   session_intw.tgz   branch int-widen: qgemv.cu's policies widening e4m3, e2m1 and int4 in integer operations;
#   session_mlatc.tgz  branch mla-tc: mla_attend_kernel on tensor cores.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
git archive 41c7a1e metrale_cli configs | gzip > session_base.tgz
for b in intw:int-widen mlatc:mla-tc; do
  git archive "${b#*:}" metrale_cli configs tests/gpu tests/conftest.py tests/engine_rows.py benchmarks pyproject.toml | gzip > "session_${b%%:*}.tgz"
done
ls -la session_*.tgz
