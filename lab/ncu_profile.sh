#!/usr/bin/env bash
# ncu of one benchmark implementation at one point (GPU machine), kept small enough to commit:
# the report's details page, its per-instruction SASS counters (xz) and their stall summary.
#   lab/ncu_profile.sh OUTDIR NAME KERNEL_REGEX [lab.profile_kernel arguments...]
#   lab/ncu_profile.sh $OUT fa3_bf16 FlashAttnFwdSm90 --impl fa3 --batch 1 --seqlen 16384
# KERNEL_REGEX matches the demangled name (fmha: HopperAttentionForward / HopperAttentionBackward;
# FA3: FlashAttnFwdSm90; FA4's SM90 backward: FlashAttentionBackwardSm90). Each profile leaves four
# files: profile into a scratch folder and tar it into $OUT (a device call returns 8 files at most).
set -u
out=$1 name=$2 regex=$3
shift 3
if ! ncu --clock-control none --kernel-name-base demangled -k "regex:$regex" --launch-skip 2 --launch-count 1 \
        --set full -o "$out/$name" python -m lab.profile_kernel "$@" > "$out/$name.log" 2>&1; then
    tail -20 "$out/$name.log"
    exit 1
fi
ncu -i "$out/$name.ncu-rep" --page details > "$out/${name}_details.txt"
ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv"
python -m lab.profile_kernel --summarize "$out/${name}_sass.csv" > "$out/${name}_stalls.md"
grep -E "^ +(Duration|Elapsed Cycles|Executed Instructions|Issue Slots Busy|Registers Per Thread|Grid Size) " \
    "$out/${name}_details.txt" | sed "s/^/$name: /"
xz -9 "$out/${name}_sass.csv" && rm -f "$out/$name.ncu-rep"
