#!/usr/bin/env bash
# session 15: the decode's auto shape with a 2-stage ring in the multi-chunk regime (S2: same chunks per CTA; S3: chunks
# per CTA for three CTAs per SM), against H. Timing only: bits must equal H's in every bit check.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
B="python bench/bisect_csrc.py --dir scratch/bn --decode --variants H S2 S3"
timeout 200 $B --cells 1x128,1x1024,1x4096,1x8192,4x128,4x1024,4x4096,4x8192,8x1024,8x4096,8x8192,16x128,16x1024,16x4096,16x8192,64x1024,128x512 --out $R/dec > $R/dec.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))"; head -1 $R/dec.log | cut -c1-200; sed -n 2p $R/dec.log | cut -c1-300
timeout 100 $B --heads 12/2 --page-size 64 --table-pages 16 --cells 1x550,16x550,32x550,64x550,128x550,256x550 --out $R/dec_engine > $R/dec_engine.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))"
python - <<'PY'
import json, os
for f in ("dec", "dec_engine"):
    rows = json.load(open(os.path.join(os.environ["OUT"], "r", f, "bisect_decode.json")))
    print(f, "checks all true:", all(v for v in rows[0].values() if isinstance(v, bool)))
    for r in rows[1:]:
        m = {k: sum(r[k]) / len(r[k]) for k in r if isinstance(r[k], list)}
        print(f"{r['batch']}x{r['ctx']}", {k: round(v, 2) for k, v in m.items()}, "eq", [r[k] for k in r if k.endswith("_eq")])
PY
tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
