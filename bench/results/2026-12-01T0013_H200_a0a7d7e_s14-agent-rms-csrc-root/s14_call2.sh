#!/usr/bin/env bash
# Session 14, call 2: the agent on the csrc rms_norm root (GPU timer, offline proposer), its export,
# the export's GPU test, and the elementwise bench with the export registered.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/stage; mkdir -p $S/agent
t0=$(date +%s)
A="python -m areal_tik.cli agent"
DB=$S/agent/agent.sqlite
timeout 200 $A init --db $DB --name rms14 --op rms_norm --preset qwen2.5-1.5b --timer gpu 2>&1 | tee $S/agent/init.log | tail -8
echo "init $(( $(date +%s) - t0 )) s"
timeout 280 $A run --db $DB --name rms14 --proposer offline --minutes 3.5 --no-live > $S/agent/run.jsonl 2> $S/agent/run.err; echo "run rc $?"
tail -3 $S/agent/run.jsonl; tail -3 $S/agent/run.err
echo "run $(( $(date +%s) - t0 )) s"
$A status --db $DB --json > $S/agent/status.json 2>&1
$A show --db $DB --name rms14 --plot $S/agent/lineage.png > $S/agent/show.json 2>&1
$A export --db $DB --name rms14 2>&1 | tee $S/agent/export.log | tail -5
cp areal_tik/kernels/exported/rms_norm_sm90.py $S/agent/ 2>/dev/null && echo "export written"
timeout 60 python bench/bench_cuda.py --elementwise-only --out $S/ew_after 2>&1 | tee $S/ew_after.log | tail -18
echo "total $(( $(date +%s) - t0 )) s"
rm -rf $S/agent/agent_work
tar czf $OUT/s14_call2.tgz -C $S .
