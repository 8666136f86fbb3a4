#!/usr/bin/env bash
# A smaller working tree for device calls that stage the GGUF (benchmarks/gguf_parts.sh): a
# call carries at most 64 MiB with the tree (~54 MiB tracked, the heads' 35 MiB of it), so
# with a head a call does not need out of the index, three tenths of the GGUF travel in one
# call instead of one (stop 64: staging in three calls of seconds, not nine of 30-90 s).
#   bash benchmarks/slim_tree.sh out PATH...   PATHs leave the index (their files stay on
#                                              disk, ignored through .git/info/exclude)
#   bash benchmarks/slim_tree.sh in            every path taken out goes back
# Put them back before any commit (`git status` shows them as deleted while out). The paths
# taken out are listed in .git/slim_tree. Prints what the tree that travels weighs.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
LIST=.git/slim_tree EXCLUDE=.git/info/exclude
case "${1:-}" in
  out)
    shift
    for p in "$@"; do
      p=${p%/}
      git rm -r -q --cached -- "$p"
      echo "/$p/" >> $EXCLUDE
      echo "$p" >> $LIST
    done ;;
  in)
    [ -f $LIST ] || { echo "nothing taken out"; exit 0; }
    while read -r p; do
      git reset -q HEAD -- "$p"
      grep -v -x -F "/$p/" $EXCLUDE > $EXCLUDE.tmp || true
      mv $EXCLUDE.tmp $EXCLUDE
    done < $LIST
    rm $LIST ;;
  *) echo "usage: $0 out PATH... | in"; exit 2 ;;
esac
git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1
