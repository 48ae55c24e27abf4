source .device-bundle/activate.sh
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv
timeout 130 python scripts/gpu_check.py --workers 15 --out /tmp/gc > /tmp/gc.log 2>&1; echo gpu_check rc=$?
cp /tmp/gc.log /tmp/gc/cli_h200.log; tar czf $OUT/gpu_check.tgz -C /tmp gc; tail -2 /tmp/gc.log
timeout 330 python -m fmha.bench --rounds 3 --out /tmp/bench > /tmp/bench.log 2>&1; echo bench rc=$?
tar czf $OUT/bench.tgz -C /tmp bench bench.log; grep -A12 "^## Summary\|median" /tmp/bench.log | head -30
for tool in racecheck synccheck; do
  timeout 70 compute-sanitizer --tool $tool python scripts/sanitize_case.py > $OUT/sanitizer_$tool.log 2>&1; echo $tool rc=$?
  tail -2 $OUT/sanitizer_$tool.log
done
