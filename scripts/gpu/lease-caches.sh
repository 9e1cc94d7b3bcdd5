# Sourced by lease.sh: the engines' JIT and compile caches under $HOME, from one lease's machine to the next one's.
# A machine's first start of each engine builds minutes of kernels that these hold; a call brings back 8 files of
# 16 MiB at most, so they go back in numbered pieces over as many calls as they need.

# most minutes saved first: FlashInfer's nvcc builds (its all-reduce fusion at TP 2 took ~200 s of a first start),
# SGLang's in a workspace of its own (hybridrl.engines.jit_cache), sgl-kernel's nvcc builds through TVM-FFI (its
# rope, KV store, QK norm and activation: ~40 s of each machine's first SGLang start, in its first CUDA graph),
# vLLM's torch.compile, Triton's kernels
caches=(.cache/flashinfer-sglang .cache/flashinfer .cache/tvm-ffi .cache/vllm .triton/cache)
# other places where a kernel build may be kept, not carried: their sizes are printed when the caches are packed,
# so that a first start that still builds something shows where
uncarried=(.nv/ComputeCache .cache/torch .cache/sglang .cache/torch_extensions)
cache_piece=$((15 * 1024 * 1024))  # what one file back from a call may hold (16 MiB), less a margin
cache_out=${HYBRIDRL_LEASE_CACHES_OUT:-/tmp/lease-caches-out}  # the pieces of this machine's caches, to send back

pack_caches() {  # OUT [N]: the engines' caches packed once into numbered 15 MiB pieces on the machine, and the
  # next N of them (default 4) copied to OUT: a call brings back 8 files of 16 MiB at most, 64 MiB together
  local out=${1:?usage: lease.sh caches-back OUT [N]} n=${2:-4} d dirs=() total i p sent=0
  if [ ! -f "$cache_out/.packed" ]; then
    rm -rf "$cache_out" && mkdir -p "$cache_out/sent"
    for d in "${caches[@]}"; do
      [ -d "$HOME/$d" ] || continue
      dirs+=("$d") && echo "lease: cache $d: $(du -sk "$HOME/$d" | cut -f1) KiB"
    done
    for d in "${uncarried[@]}"; do
      if [ -d "$HOME/$d" ]; then echo "lease: not carried: $d: $(du -sk "$HOME/$d" | cut -f1) KiB"; fi
    done
    if [ ${#dirs[@]} -gt 0 ]; then
      tar czf "$cache_out/all.tgz" -C "$HOME" "${dirs[@]}"
      split -b "$cache_piece" -d -a 3 "$cache_out/all.tgz" "$cache_out/piece."
      rm "$cache_out/all.tgz"
      total=$(ls "$cache_out"/piece.* | wc -l)
      for p in "$cache_out"/piece.*; do mv "$p" "$cache_out/caches-${p##*.}-of-$(printf %03d "$total").part"; done
    fi
    touch "$cache_out/.packed"
  fi
  for p in "$cache_out"/caches-*.part; do
    [ -f "$p" ] && [ "$sent" -lt "$n" ] || continue
    cp "$p" "$out/" && mv "$p" "$cache_out/sent/" && sent=$((sent + 1))
  done
  total=$(find "$cache_out" -name 'caches-*.part' | wc -l)
  i=$(find "$cache_out" -maxdepth 1 -name 'caches-*.part' | wc -l)
  echo "lease: caches: $sent piece(s) in this call's files, $((total - i)) of $total sent;" \
    "$([ "$i" -eq 0 ] && echo "all sent" || echo "$i left: lease.sh caches-back \$OUT")"
}

join_caches() {  # DIR...: the pieces the lease's calls brought back, wherever they lie, into .gpu/caches.tar.gz
  local p pieces=() total want
  while IFS=$'\t' read -r _ p; do pieces+=("$p"); done < <(for d in "$@"; do
    for p in "$d"/caches-*-of-*.part; do [ ! -f "$p" ] || printf '%s\t%s\n' "$(basename "$p")" "$p"; done
  done | sort -u -t$'\t' -k1,1)  # each piece once, in order, whichever call brought it
  [ ${#pieces[@]} -gt 0 ] || { echo "lease: no cache pieces in $*"; return 0; }
  total=${pieces[0]##*-of-} && total=$((10#${total%.part}))
  [ ${#pieces[@]} -eq "$total" ] || die "caches: ${#pieces[@]} of $total pieces in $*: name every folder the" \
    "lease's calls brought pieces to (each \`caches-back\` call's); nothing written"
  want=$(printf '%s\n' "${pieces[@]}" | sed 's/.*caches-\([0-9]*\)-of-.*/\1/' | tr '\n' ' ')
  [ "$want" = "$(seq -f %03g 0 $((total - 1)) | tr '\n' ' ')" ] || die "caches: the pieces are not 000 to $((total - 1))"
  mkdir -p "$gpu" && cat "${pieces[@]}" > "$gpu/caches.tar.gz.tmp" && mv "$gpu/caches.tar.gz.tmp" "$gpu/caches.tar.gz"
  echo "lease: the engines' caches kept in $gpu ($(($(stat -c %s "$gpu/caches.tar.gz") / 1024)) KiB, $total pieces)"
}
