# Does ninja rebuild FlashInfer's carried JIT ops only because pip writes the overlay with new mtimes?
D=.gpu/fitest
tar xzf $D/fi-cache.tgz -C "$HOME"
pip install -q --no-deps --target /tmp/envs/vllm $D/*.whl 2>&1 | grep -v -i warn
NINJA=$(command -v ninja || ls /tmp/envs/vllm/bin/ninja 2>/dev/null || python3 -c "import ninja,os;print(os.path.join(ninja.BIN_DIR,'ninja'))")
echo "ninja: $NINJA $($NINJA --version)"
ops="sampling trtllm_comm norm"
probe() {
  for op in $ops; do
    d=$HOME/.cache/flashinfer/0.6.14/90a/cached_ops/$op
    echo "-- $op ($1)"; (cd $d && $NINJA -n -d explain -f build.ninja 2>&1 | grep -v "^\[" | head -4)
  done
}
probe "fresh pip install"
t=$SECONDS; find /tmp/envs/vllm -exec touch -h -d @946684800 {} +; echo "touched in $((SECONDS - t)) s"
probe "overlay at one old mtime"
