# Sourced by this folder's scripts: unpacks the carried packages of build/gpurun/pkg (debs into
# /tmp/debs, engine trees and wheels into /tmp/site) and points the loader at them and at the
# CUDA runtime of torch's wheel. Sets B (build/gpurun) and T (its tree).
B=$PWD/build/gpurun; T=$B/tree
mkdir -p /tmp/debs /tmp/site
for f in "$B"/pkg/*.deb; do dpkg -x "$f" /tmp/debs; done
for f in "$B"/pkg/*.tgz; do tar xzf "$f" -C /tmp/site; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/pkg/*.whl
CUDART=$(python3 -c "import glob, os, site; print(':'.join(sorted({os.path.dirname(p) for d in site.getsitepackages() for p in glob.glob(d + '/nvidia/**/libcudart.so.13*', recursive=True)})))")
export LD_LIBRARY_PATH="/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
