#!/usr/bin/env bash
# Extract FlashAttention-4's tests (tests/cute/test_flash_attn*.py that exist, their conftest.py and
# any local module they import from tests/cute/) from a git mirror of Dao-AILab/flash-attention
# into .fa-tests/ (ignored by git: FlashAttention's test code is never committed here), and record
# where they came from in .fa-tests/SOURCE.
#
#   lab/fa_tests/get_tests.sh [GIT_DIR] [REV]
#
# GIT_DIR: the mirror's git directory (default $FA_GIT_DIR, else the fetched mirror's usual path).
# REV: default fa4-v4.0.0.beta27 = 0251105a, the newest FA4 tag in the mirror. The installed wheel,
# flash-attn-4 4.0.0b36, was built from a later commit the mirror does not have (its interface.py
# matches no commit there); its public signatures are a superset of beta27's.
set -euo pipefail
git_dir=${1:-${FA_GIT_DIR:-/work/.mirror/Dao-AILab+flash-attention/repo}}
rev=${2:-fa4-v4.0.0.beta27}
out=${FA_TESTS_DIR:-.fa-tests}
g() { git --git-dir="$git_dir" "$@"; }

commit=$(g rev-parse --verify "$rev^{commit}")
rm -rf "$out"
mkdir -p "$out"
wanted=(tests/cute/test_flash_attn.py tests/cute/test_flash_attn_varlen.py tests/cute/conftest.py)
extracted=()
for path in "${wanted[@]}"; do
  if g cat-file -e "$commit:$path" 2>/dev/null; then
    g show "$commit:$path" > "$out/$(basename "$path")"
    extracted+=("$path")
  fi
done
# local helpers: a top-level "import X" / "from X import" naming a module that lives in tests/cute/
for file in "$out"/test_*.py; do
  for module in $(sed -nE 's/^(from|import) +([A-Za-z_][A-Za-z0-9_]*).*/\2/p' "$file" | sort -u); do
    helper=tests/cute/$module.py
    if [ ! -f "$out/$module.py" ] && g cat-file -e "$commit:$helper" 2>/dev/null; then
      g show "$commit:$helper" > "$out/$module.py"
      extracted+=("$helper")
    fi
  done
done
{
  echo "Dao-AILab/flash-attention $rev = $commit ($(g log -1 --format=%cs "$commit")): ${extracted[*]}"
} > "$out/SOURCE"
cat "$out/SOURCE"
